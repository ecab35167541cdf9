"""The privacy ledger across checkpoints and resume; what is saved is a plain HF model."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel, TrainerCallback, ViTForImageClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments, PrivacyLedger
from hf_dp_repr.privacy.ledger import Phase, PrivacyPlan
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit

PLANNED_STEPS = 6


class StopAt(TrainerCallback):
    """Simulates a run killed right after the checkpoint of `step`."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_trainer(output_dir, dataset, callbacks=()):
    args = DPTrainingArguments(
        output_dir=str(output_dir), target_epsilon=4.0, target_delta=1e-4, per_device_train_batch_size=32,
        gradient_accumulation_steps=2, max_steps=PLANNED_STEPS, save_strategy="steps", save_steps=3,
        learning_rate=1e-3, report_to="none", disable_tqdm=True, seed=7, logging_steps=1,
    )
    return DPTrainer(model=tiny_vit(), args=args, train_dataset=dataset, callbacks=list(callbacks))


def test_killed_and_resumed_run_spends_the_same_epsilon(digits, tmp_path):
    dataset = digits["train"].select(range(400))
    full = make_trainer(tmp_path / "full", dataset)
    full_out = full.train()

    killed = make_trainer(tmp_path / "killed", dataset, [StopAt(3)])
    killed.train()
    assert killed.ledger.steps_done == 3
    checkpoint = tmp_path / "killed" / "checkpoint-3"
    saved = json.loads((checkpoint / "privacy_ledger.json").read_text())
    assert saved["steps_done"] == 3 and saved["history"][0][2] == 3

    resumed = make_trainer(tmp_path / "killed", dataset)
    resumed_out = resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.steps_done == PLANNED_STEPS == full.ledger.steps_done
    assert resumed.ledger.history == full.ledger.history
    assert resumed_out.metrics["epsilon"] == full_out.metrics["epsilon"] <= 4.0


def test_resume_refuses_a_changed_plan_and_missing_ledger(digits, tmp_path):
    dataset = digits["train"].select(range(400))
    make_trainer(tmp_path / "run", dataset, [StopAt(3)]).train()
    changed = make_trainer(tmp_path / "run", dataset.select(range(300)))
    with pytest.raises(ValueError, match="privacy plan changed"):
        changed.train(resume_from_checkpoint=True)
    os.remove(tmp_path / "run" / "checkpoint-3" / "privacy_ledger.json")
    with pytest.raises(ValueError, match="no privacy_ledger.json"):
        make_trainer(tmp_path / "run", dataset).train(resume_from_checkpoint=True)


def test_ledger_never_goes_past_planned_steps():
    ledger = PrivacyLedger(PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0,
                                       clipping="flat", dataset_size=100, poisson_sampling=True,
                                       phases=[Phase("train", 1.0, 0.1, 2, 10)]))
    ledger.record_step()
    ledger.record_step()
    with pytest.raises(RuntimeError, match="budget exhausted"):
        ledger.record_step()
    assert ledger.steps_done == 2


def test_epsilon_is_logged_at_every_logging_step(digits, tmp_path):
    trainer = make_trainer(tmp_path / "log", digits["train"].select(range(400)))
    trainer.train()
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(train_logs) == PLANNED_STEPS
    epsilons = [entry["epsilon"] for entry in train_logs]
    assert all(a < b for a, b in zip(epsilons, epsilons[1:]))  # grows with every step
    assert epsilons[-1] <= 4.0
    assert not any("grad_norm" in entry for entry in trainer.state.log_history)  # non-private: never logged


def test_saved_vit_is_plain_hf_and_reloads(digits, tmp_path):
    trainer = make_trainer(tmp_path / "vit", digits["train"].select(range(400)))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    keys = load_file(str(tmp_path / "final" / "model.safetensors")).keys()
    assert not any("_module" in k or "grad_sample" in k for k in keys)
    reloaded = ViTForImageClassification.from_pretrained(str(tmp_path / "final")).eval()
    batch = digits["test"][:8]["pixel_values"]
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pixel_values=batch).logits, trainer.model(pixel_values=batch).logits)
    assert PrivacyLedger.load(str(tmp_path / "final")).steps_done == PLANNED_STEPS


def test_gpt2_trains_saves_reloads_and_generates(token_dataset, tmp_path):
    model = tiny_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPTrainingArguments(output_dir=str(tmp_path / "gpt2"), target_epsilon=8.0, target_delta=1e-3,
                               per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                               learning_rate=1e-2, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=token_dataset)
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    trainer.save_model()
    reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "gpt2"))
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # still tied
    out = reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
