"""One-run canary audit (Steinke, Nasr & Jagielski 2023) on sklearn's digits with a tiny ViT.

The three training runs share the canaries and the inclusion draw (an explicit, non-secret seed for the test):
a non-private Trainer that memorises them, DPTrainer at ε = 1, and DPTrainer with noise_multiplier=0 (clipping
only). 100 training rows + the included canaries (147), 60 epochs of batch 32: 300 steps a run, 20-60 s each on 2
busy cores (measured: the control and the clipping-only run guess 37 of 40 canaries right, ε ≥ 1.50; the ε = 1 run
21 of 40, ε ≥ 0)."""

import numpy as np
import pytest
from transformers import TrainingArguments

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.audit.canaries import (
    draw_inclusion,
    guess,
    make_canaries,
    one_run_audit,
    score_guesses,
    train_with_canaries,
    with_canaries,
)
from hf_dp_repr.tiny import tiny_vit

SMALL_VIT = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
N_TRAIN, M, K, EPOCHS = 100, 100, 20, 60


def test_inclusion_draw_is_secret_by_default_and_ignores_global_seeds():
    import torch

    np.random.seed(0)
    torch.manual_seed(0)
    a = draw_inclusion(256)
    np.random.seed(0)
    torch.manual_seed(0)
    b = draw_inclusion(256)
    assert not np.array_equal(a, b)  # OS entropy, not the (public) global seeds
    assert np.array_equal(draw_inclusion(256, seed=5), draw_inclusion(256, seed=5))
    assert 0.3 < draw_inclusion(4000).mean() < 0.7


def test_canaries_and_training_set(digits):
    canaries = make_canaries(digits["test"], 50, "mislabelled", seed=0)
    assert len(canaries) == 50 and canaries.features == digits["test"].features
    # every mislabelled canary is a test image under a wrong label
    test_px = np.asarray(digits["test"].with_format("numpy")[:]["pixel_values"]).reshape(len(digits["test"]), -1)
    test_y = np.asarray(digits["test"].with_format("numpy")[:]["labels"])
    can = canaries.with_format("numpy")[:]
    for px, y in zip(can["pixel_values"], can["labels"]):
        row = np.flatnonzero((test_px == px.reshape(-1)).all(1))[0]
        assert int(y) != test_y[row]
    ood = make_canaries(digits["test"], 10, "ood", seed=0)
    assert not np.isin(ood.with_format("numpy")[:]["pixel_values"], np.arange(-8, 9) / 8).any()  # not digit pixels
    included = draw_inclusion(50, seed=1)
    data = with_canaries(digits["train"].select(range(20)), canaries, included)
    assert len(data) == 20 + included.sum()
    with pytest.raises(ValueError, match="kind"):
        make_canaries(digits["test"], 5, "gradient")


def test_guesses_and_scoring():
    losses = np.array([0.1, 5.0, 0.2, 4.0, 0.3, 3.0])
    included = np.array([True, False, False, False, True, True])
    g = guess(losses, k=2)
    assert g.tolist() == [1, -1, 1, -1, 0, 0]
    assert score_guesses(g, included) == (4, 3)  # canary 2 guessed "in" but was left out
    out = one_run_audit(losses, included, k=2, delta=1e-5)
    assert (out["guesses"], out["correct"]) == (4, 3) and out["epsilon_lower_bound"] == 0.0
    with pytest.raises(ValueError, match="2k"):
        guess(losses, k=4)


def _audit(digits, args):
    train = digits["train"].select(range(N_TRAIN))
    canaries = make_canaries(digits["test"], M, "ood", seed=1)
    out = train_with_canaries(tiny_vit(**SMALL_VIT), args, train, canaries, k=K, inclusion_seed=3)
    print({k: v for k, v in out.items() if k != "trainer_obj"})
    return out


def _common(tmp_path):
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=32, num_train_epochs=EPOCHS, learning_rate=3e-3,
                report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)


@pytest.fixture(scope="module")
def audits(digits, tmp_path_factory):
    """The three runs on the same canaries and inclusion draw."""
    tmp = tmp_path_factory.mktemp("canary-audit")
    control = _audit(digits, TrainingArguments(**_common(tmp / "control")))
    add_remove = dict(neighboring="add_remove")  # canaries added or left out test an add/remove claim
    dp_eps1 = _audit(digits, DPTrainingArguments(target_epsilon=1.0, target_delta=1e-5, noise_seed=0, **add_remove,
                                                 **_common(tmp / "dp")))
    clip_only = _audit(digits, DPTrainingArguments(noise_multiplier=0.0, target_delta=1e-5, noise_seed=0,
                                                   **add_remove, **_common(tmp / "clip")))
    return control, dp_eps1, clip_only


@pytest.mark.slow
def test_non_private_control_has_a_positive_lower_bound(audits):
    control, _, _ = audits
    assert control["claimed_epsilon"] is None  # ε = ∞
    assert control["correct"] >= 0.85 * control["guesses"]
    assert control["epsilon_lower_bound"] > 1.0


@pytest.mark.slow
def test_dp_run_at_epsilon_1_stays_below_its_claim(audits):
    _, dp, _ = audits
    assert 0.99 <= dp["claimed_epsilon"] <= 1.0
    assert dp["epsilon_lower_bound"] <= dp["claimed_epsilon"]


@pytest.mark.slow
def test_clipping_only_run_is_told_apart_from_epsilon_1(audits):
    _, dp, clip_only = audits
    assert clip_only["noise_multiplier"] == 0.0 and clip_only["claimed_epsilon"] is None
    assert clip_only["epsilon_lower_bound"] > dp["epsilon_lower_bound"] + 1.0


def test_bound_goes_into_the_card_only_when_asked(tmp_path):
    import json

    from hf_dp_repr.audit.canaries import save_canary_audit
    from hf_dp_repr.hub import files_to_push
    from hf_dp_repr.hub.card import refresh_model_card
    from hf_dp_repr.privacy.accounting import compute_epsilon

    led = dict(accountant="prv", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat", dataset_size=347,
               poisson_sampling=True, target_epsilon=1.0, planned_steps=100, steps_done=100,
               phases=[dict(name="train", noise_multiplier=8.6, sample_rate=0.09, steps=100, expected_batch_size=32)],
               history=[(8.6, 0.09, 100)], epsilon=compute_epsilon([(8.6, 0.09, 100)], 1e-5))
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(led))
    assert "canary audit" not in refresh_model_card(tmp_path).text  # nothing unless asked
    result = one_run_audit(np.r_[np.zeros(20), np.ones(60), np.full(20, 5.0)], np.r_[np.ones(20), np.zeros(80)] > 0,
                           k=20, delta=1e-5)
    save_canary_audit(result, str(tmp_path))
    card = (tmp_path / "README.md").read_text()
    # 20 right "in" (losses 0) + 20 right "out" (losses 5): 40 of 40, the bound of test_audit_bounds' formula
    assert "40 of 40" in card and "ε ≥ **2.551**" in card and "95 % confidence" in card
    assert "canary_audit.json" in files_to_push(tmp_path)
    saved = json.loads((tmp_path / "canary_audit.json").read_text())
    assert not any(isinstance(v, list) for v in saved.values())  # counts only: the secret draw is not written


def test_replace_one_claims_are_not_audited_with_add_remove_canaries(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, target_delta=1e-5, accountant="pld",
                               neighboring="replace_one", report_to="none", save_strategy="no")
    canaries = make_canaries(digits["test"], 10, "ood", seed=0)
    with pytest.raises(ValueError, match="neighboring='add_remove'"):
        train_with_canaries(tiny_vit(**SMALL_VIT), args, digits["train"].select(range(20)), canaries, k=2)
    assert not any(tmp_path.iterdir())  # refused before training: nothing written
