"""What leaves beside the model states a guarantee that holds for it. The ledger and the card publish n (and the
sample rate, steps and epochs, which reveal it), so the guarantee they can state is the replace-one one: by default
a run is accounted for replace-one neighbours, and a run planned for add/remove neighbours gets a card whose ε is
its replace-one ε. Every ε is checked against dp_accounting; the metrics files hold nothing about the batches drawn.
"""

import json
import re

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.hub import check_pushable, public_metrics
from hf_dp_repr.hub.card import render_model_card
from hf_dp_repr.tiny import tiny_vit


def dp_accounting_epsilon(history, delta, relation):
    """ε from dp_accounting's privacy loss distributions at its default (finest) discretisation."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    acc = PLDAccountant(getattr(dp_accounting.NeighboringRelation, relation))
    for sigma, q, steps in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps))
    return acc.get_epsilon(delta)


def stated_epsilon(card_text: str) -> float:
    """The ε the card's first line claims."""
    return float(re.search(r"\(ε = ([\d.]+), δ = [^)]*\)-differentially private", card_text).group(1))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, digits):
    # The review's run: n = 400, logical batch 40, 2 epochs; nothing about the accountant or relation is set.
    out = tmp_path_factory.mktemp("default_run")
    args = DPTrainingArguments(output_dir=str(out), target_epsilon=2.0, target_delta=1e-5, num_train_epochs=2,
                               per_device_train_batch_size=40, report_to="none", save_strategy="no",
                               disable_tqdm=True, logging_strategy="no")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(400)))
    result = trainer.train()
    trainer.save_metrics("all", result.metrics)
    trainer.save_model()
    return trainer, out


def test_a_default_run_states_the_replace_one_guarantee_dp_accounting_computes(default_run):
    trainer, out = default_run
    ledger = json.loads((out / "privacy_ledger.json").read_text())
    assert ledger["dataset_size"] == 400 and ledger["history"] == [[pytest.approx(ledger["phases"][0][
        "noise_multiplier"]), 0.1, 20]]  # n, q and steps are published...
    assert ledger["neighboring"] == "replace_one"  # ...so ε is stated for neighbours of the same size
    truth = dp_accounting_epsilon(ledger["history"], 1e-5, "REPLACE_ONE")
    assert truth <= ledger["epsilon"] <= 2.0 and ledger["epsilon"] == pytest.approx(truth, rel=2e-3)
    assert trainer.epsilon() == ledger["epsilon"]
    card = ModelCard.load(out / "README.md").text
    assert truth <= stated_epsilon(card) <= 2.0  # rounded up, never below what dp_accounting computes
    assert "replace one example (n is public" in card and "treated as private" not in card
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["epsilon"] == ledger["epsilon"]


def test_the_metrics_files_hold_nothing_about_the_batches_drawn(default_run):
    # total_flos = 6 · parameters · Σ |B_t| · tokens: it would give the sizes of the secret Poisson batches.
    trainer, out = default_run
    assert trainer.state.total_flos == 0  # a DP run counts none (test_total_flos_reaches_no_log_...)
    for name in ("all_results.json",):
        assert "total_flos" not in json.loads((out / name).read_text())
    assert public_metrics({"total_flos": 1.0e9, "epoch": 2.0, "eval_loss": 0.5}) == {"epoch": 2.0, "eval_loss": 0.5}
    (out / "eval_results.json").write_text(json.dumps({"eval_loss": 0.5, "total_flos": 1.0e9}))
    try:
        with pytest.raises(ValueError, match="eval_results.json holds total_flos"):
            check_pushable(out)
        # every counter of the batches' rows or tokens, by a rule (num_input_tokens_seen and TRL's eval_num_tokens
        # passed it when it listed two names: seen failing so); the eval set's own size and speed are public
        counters = {"num_input_tokens_seen": 630, "eval_num_tokens": 154, "train_tokens_per_second": 3.0,
                    "total_samples_seen": 12, "eval_num_examples_seen": 3, "rewards/num_sequences": 4}
        assert public_metrics({**counters, "eval_samples": 16, "eval_samples_per_second": 9.0, "eval_loss": 0.5,
                               "eval_mean_token_accuracy": 0.2}) == {
            "eval_samples": 16, "eval_samples_per_second": 9.0, "eval_loss": 0.5, "eval_mean_token_accuracy": 0.2}
        for key, value in counters.items():
            (out / "eval_results.json").write_text(json.dumps({"eval_loss": 0.5, key: value}))
            with pytest.raises(ValueError, match=f"eval_results.json holds {key}"):
                check_pushable(out)
    finally:
        (out / "eval_results.json").unlink()


class Onlooker(TrainerCallback):
    """What a callback (and so any `report_to` tracker) can read: the logs, and each parameter's tensors and tensor
    attributes just before the optimizer step."""

    def __init__(self):
        self.logs, self.before_step = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before_step.append({f"{name}.{attr}": value for name, p in model.named_parameters() if p.requires_grad
                                 for attr, value in [("grad", p.grad), *vars(p).items()]
                                 if isinstance(value, torch.Tensor)})


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("watched_run")
    onlooker = Onlooker()
    args = DPTrainingArguments(output_dir=str(out), noise_multiplier=1.0, max_steps=2, per_device_train_batch_size=8,
                               gradient_accumulation_steps=2, logging_steps=1, save_steps=2, report_to="none",
                               disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(64)),
                        callbacks=[onlooker])
    result = trainer.train()
    return trainer, out, onlooker, result


def test_total_flos_reaches_no_log_tracker_or_checkpoint(watched_run):
    # The Trainer's total_flos (6 · parameters · Σ|B_t| · pixels) gave the secret batch sizes to every on_log.
    trainer, out, onlooker, result = watched_run
    assert onlooker.logs and not any("total_flos" in logs for logs in onlooker.logs)
    assert not any("total_flos" in entry for entry in trainer.state.log_history)
    assert "total_flos" not in result.metrics
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["total_flos"] == 0 and not any("total_flos" in entry for entry in state["log_history"])


def test_callbacks_see_no_pre_noise_sum_before_the_optimizer_step(watched_run):
    # At on_pre_optimizer_step each parameter carried `summed_grad`: the clipped sum before noise.
    _, _, onlooker, _ = watched_run
    assert len(onlooker.before_step) == 2 and onlooker.before_step == [{}, {}]


def test_an_add_remove_run_gets_a_card_whose_guarantee_is_its_replace_one_epsilon():
    # The review's numbers: add/remove ε 1.999 on (n = 400, batch 40, 2 epochs) is about 2.87 replace-one.
    from hf_dp_repr.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

    sigma = calibrate_noise_multiplier(1.999, 1e-5, 0.1, 20, "prv")
    history = [[sigma, 0.1, 20]]
    add_remove = compute_epsilon(history, 1e-5, "prv")
    led = dict(accountant="prv", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat", dataset_size=400,
               poisson_sampling=True, target_epsilon=1.999, neighboring="add_remove", history=history,
               phases=[dict(name="train", noise_multiplier=sigma, sample_rate=0.1, steps=20, expected_batch_size=40)],
               steps_done=20, planned_steps=20, epsilon=add_remove)
    card = render_model_card(led, model_card_info={"model_name": "tiny_vit on digits"})
    truth = dp_accounting_epsilon(history, 1e-5, "REPLACE_ONE")
    assert 2.8 < truth and add_remove < 2.0
    assert truth <= stated_epsilon(card.text) <= truth * 1.002  # the headline is the replace-one ε
    assert card.text.lstrip().startswith(f"# tiny_vit on digits (DP-SGD, ε = {stated_epsilon(card.text):g})")
    plan_row = re.search(r"\| ε for add/remove neighbours \(the plan's; needs n secret\) \| ([\d.]+) \|", card.text)
    assert add_remove <= float(plan_row.group(1)) <= add_remove * 1.001  # the plan's ε, with its condition:
    assert "holds only while n and what reveals it (sample rate, steps, epochs) stay secret" in card.text
