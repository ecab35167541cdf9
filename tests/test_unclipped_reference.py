"""The true non-private reference: `clipping="none"` with `noise_multiplier=0` runs through the same DPTrainer, its
update is the plain mean gradient, and the ledger, the log and the card say ε = ∞ and "no clipping"."""

import copy
import json
import logging

import pytest

from hf_dp_repr import DPConfigError, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit
from utils import brute_force_update, relative_error, run_one_step


def test_unclipped_update_is_the_plain_gradient_and_is_labelled(digits, tmp_path, caplog):
    data = digits["train"].select(range(24))
    model = tiny_vit(num_labels=10)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING):
        grads, batch = run_one_step(model, data, tmp_path, noise_multiplier=0.0, clipping="none",
                                    per_sample_max_grad_norm=1e-3)  # a C this small would clip every example
    plain = brute_force_update(reference, data, batch, clip=float("inf"), clipping="flat")
    clipped = brute_force_update(copy.deepcopy(reference), data, batch, clip=1e-3, clipping="flat")
    assert relative_error(grads, plain) <= 1e-5 and relative_error(grads, clipped) > 0.5
    assert "NOT differentially private (ε = ∞); no clipping (the plain gradient)" in caplog.text


def test_ledger_and_card_say_no_clipping(digits, tmp_path):
    from hf_dp_repr import DPTrainer

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, clipping="none", max_steps=1,
                               per_device_train_batch_size=64, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=digits["train"])
    trainer.train()
    trainer.save_model()
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["clipping"] == "none" and ledger["epsilon"] is None  # ε = ∞ is stored as null
    card = (tmp_path / "README.md").read_text()
    assert "NOT differentially private (ε = ∞)" in card and "no clipping: the plain gradient" in card


@pytest.mark.parametrize("budget", [{"noise_multiplier": 1.0}, {"target_epsilon": 8.0}])
def test_unclipped_is_refused_with_any_noise(budget, tmp_path):
    with pytest.raises(DPConfigError, match="clipping='none' bounds no example's influence"):
        DPTrainingArguments(output_dir=str(tmp_path), clipping="none", report_to="none", **budget)
