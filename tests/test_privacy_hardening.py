"""One example = one row, float32 clipping, the neighbouring relation, and the Trainer options DP-SGD cannot take."""

import copy

import pytest
import torch
from opacus.grad_sample import GradSampleHooks
from transformers import DataCollatorWithFlattening, TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments, compute_epsilon
from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer
from hf_dp_repr.privacy.randomness import DPRandomness
from hf_dp_repr.privacy.validation import check_one_row_per_example
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit


def dp_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), target_epsilon=4.0, target_delta=1e-4, report_to="none",
                save_strategy="no", disable_tqdm=True, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                weight_decay=0.0)
    return DPTrainingArguments(**{**base, **kw})


# ---- packed rows --------------------------------------------------------------------------------------
def test_packed_batches_are_refused_before_training(token_dataset, tmp_path):
    model = tiny_gpt2()
    before = copy.deepcopy(model.state_dict())
    rows = token_dataset.with_format(None).map(lambda r: {"input_ids": r["input_ids"][: sum(r["attention_mask"])]},
                                               remove_columns=["attention_mask", "labels"])
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, per_device_train_batch_size=4, max_steps=2),
                        train_dataset=rows, data_collator=DataCollatorWithFlattening())
    with pytest.raises(ValueError, match="no packing under DP-SGD"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert trainer.ledger is None  # no step was accounted, none was taken


def test_one_row_per_example_check():
    ids = torch.arange(12).view(2, 6)
    check_one_row_per_example({"input_ids": ids, "labels": ids}, 2)
    left_padded = {"position_ids": torch.tensor([[1, 1, 0, 1, 2, 3]]),
                   "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1]])}
    check_one_row_per_example(left_padded, 1)
    with pytest.raises(ValueError, match="`input_ids` has shape \\(1, 12\\) for 2 examples"):
        check_one_row_per_example({"input_ids": ids.view(1, 12)}, 2)
    with pytest.raises(ValueError, match="`position_ids` restart inside a row"):
        check_one_row_per_example({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}, 1)


# ---- float32 clipping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("clipping", ["flat", "automatic", "per_layer"])
def test_bf16_contributions_stay_within_the_clipping_norm(digits, clipping):
    torch.manual_seed(0)
    model = tiny_vit(num_labels=10).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = 1e-2  # far below every example's gradient norm: every example is clipped
    opt = MicroBatchDPOptimizer(torch.optim.SGD(params, lr=0.1), clipping=clipping, noise_multiplier=0.0,
                                max_grad_norm=clip, expected_batch_size=1,
                                noise_generator=lambda device: DPRandomness().noise_generator(0, device))
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
    worst = 0.0
    for i in range(16):
        x = digits["train"][i]
        logits = model(pixel_values=x["pixel_values"][None].to(torch.bfloat16)).logits
        torch.nn.functional.cross_entropy(logits.float(), x["labels"][None]).backward()
        opt.accumulate_micro_batch()
        assert all(p.summed_grad.dtype == torch.float32 for p in params)
        worst = max(worst, torch.sqrt(sum((p.summed_grad.double() ** 2).sum() for p in params)).item() / clip)
        for p in params:
            p.summed_grad = None
    hooks.remove_hooks()
    # Contributions reach C (they are clipped; per layer, small tensors stay under C/√k) and never exceed it.
    assert (0.5 if clipping == "per_layer" else 0.99) < worst <= 1 + 1e-6


# ---- the neighbouring relation ---------------------------------------------------------------------------
def test_replace_one_accounting_through_the_trainer(digits, tmp_path):
    data = digits["train"].select(range(200))
    args = dp_args(tmp_path, per_device_train_batch_size=20, max_steps=3, neighboring="replace_one",
                   accountant="pld", target_epsilon=2.0)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=data)
    out = trainer.train()
    led = trainer.ledger
    assert led.plan.neighboring == "replace_one" and led.to_dict()["neighboring"] == "replace_one"
    assert out.metrics["epsilon"] == compute_epsilon(led.history, 1e-4, "pld", "replace_one") <= 2.0
    assert compute_epsilon(led.history, 1e-4, "pld") < out.metrics["epsilon"]  # add/remove is smaller


# ---- Trainer options ----------------------------------------------------------------------------------------
def test_ignore_data_skip_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ignore_data_skip=True would replay"):
        dp_args(tmp_path, ignore_data_skip=True)


def test_empty_micro_batches_with_a_causal_lm(token_dataset, tmp_path):
    # per-device batch 1 × 8 micro-batches: many are empty; transformers' token count crashed on them.
    args = dp_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=8, max_steps=4,
                   noise_seed=0)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset)
    trainer.train()
    assert trainer.ledger.steps_done == 4


class CaptureFirstUpdate(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_gradient_checkpointing(token_dataset, tmp_path):
    with pytest.raises(ValueError, match="use_reentrant"):
        dp_args(tmp_path, gradient_checkpointing=True)
    updates = []
    for checkpointing in (False, True):
        extra = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}) \
            if checkpointing else {}
        capture = CaptureFirstUpdate()
        args = dp_args(tmp_path / str(checkpointing), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       max_steps=1, noise_multiplier=0.0, target_epsilon=None, per_sample_max_grad_norm=0.5,
                       noise_seed=0, **extra)
        DPTrainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset, callbacks=[capture]).train()
        updates.append(capture.grads)
    plain, checkpointed = updates
    err = sum(((plain[n] - checkpointed[n]) ** 2).sum() for n in plain) / sum((plain[n] ** 2).sum() for n in plain)
    assert err.sqrt().item() <= 1e-5


def test_hyperparameter_search_objective_is_not_epsilon(digits, tmp_path):
    # DPTrainer logs ε; it used to write it into the eval metrics too, and the Trainer's default objective (the sum
    # of the metrics) then scored every trial by ε.
    from transformers.trainer_utils import default_compute_objective

    args = dp_args(tmp_path, per_device_train_batch_size=16, max_steps=1, logging_steps=1)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=digits["train"].select(range(64)),
                        eval_dataset=digits["test"].select(range(32)))
    trainer.train()
    metrics = trainer.evaluate()
    assert not any(k.startswith("epsilon") for k in metrics)
    assert default_compute_objective(metrics) == metrics["eval_loss"]
    assert any("epsilon" in entry for entry in trainer.state.log_history)  # ε is still logged
