"""Resuming (checkpoints/resume.py, output_dir.py; issue 23 items 1, 2, 3, 5; issue 22 item 5): a checkpoint is whole or
absent, resume takes the newest complete one, spends the same ε as an uninterrupted run and refuses a changed plan,
steps lost to a kill are charged, output_dir is checked before any work and a refusal writes nothing, a recipe rerun
resumes, and a changed argument on resume is named, refused or ignored. What is saved is a plain HF model."""

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, ViTForImageClassification
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments, PrivacyLedger
from hf_dp_repr.errors import DPConfigError, OutputDirError
from hf_dp_repr.privacy.accounting import compute_epsilon
from hf_dp_repr.tiny import tiny_vit

STEPS, EVERY = 6, 3


class KillAt(TrainerCallback):
    """A kill (SIGINT) right after the noisy step `step`, before the run saves anything more."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def _trainer(out, data, callbacks=(), **overrides):
    kwargs = dict(output_dir=str(out), noise_multiplier=1.0, target_delta=1e-3, accountant="rdp", max_steps=STEPS,
                  per_device_train_batch_size=16, save_strategy="steps", save_steps=EVERY, learning_rate=1e-3,
                  report_to="none", disable_tqdm=True, seed=0)
    kwargs.update(overrides)
    return DPTrainer(model=tiny_vit(), args=DPTrainingArguments(**kwargs), train_dataset=data,
                     callbacks=list(callbacks))


@pytest.fixture
def data(digits):
    return digits["train"].select(range(128))


def _resume(out, data, **overrides):
    trainer = _trainer(out, data, **overrides)
    with CaptureLogger(logging.get_logger("hf_dp_repr")) as log:
        result = trainer.train(resume_from_checkpoint=True)
    return trainer, result, log.out


# ---- item 1: a checkpoint is whole or absent; resume takes the newest complete one ------------------------------
def test_a_save_interrupted_after_the_model_file_leaves_no_checkpoint_and_resume_takes_the_previous(
        data, tmp_path, monkeypatch):
    save_optimizer = Trainer._save_optimizer_and_scheduler

    def interrupted(self, output_dir):
        if self.state.global_step == 2 * EVERY:  # the model file of checkpoint-6 is written: SIGINT now
            assert os.path.isfile(os.path.join(output_dir, "model.safetensors"))
            raise KeyboardInterrupt
        save_optimizer(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, data).train()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    assert {"optimizer.pt", "trainer_state.json", "privacy_ledger.json", "training_args.json"} <= {
        p.name for p in (tmp_path / "checkpoint-3").iterdir()}

    resumed, _, log = _resume(tmp_path, data)
    assert f"resuming from {tmp_path / 'checkpoint-3'}" in log
    assert resumed.ledger.steps_done == STEPS and resumed.ledger.recomputed_steps == ((4, 6),)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not (tmp_path / ".checkpoint-staging").exists()


def test_a_truncated_ledger_is_skipped_and_named(data, tmp_path):
    _trainer(tmp_path, data).train()
    (tmp_path / "checkpoint-6" / "privacy_ledger.json").write_text("")  # what a kill during an old save left
    resumed, _, log = _resume(tmp_path, data)
    assert "skipping incomplete checkpoint(s)" in log and "checkpoint-6 (privacy_ledger.json unreadable" in log
    assert f"resuming from {tmp_path / 'checkpoint-3'}" in log
    assert resumed.ledger.steps_done == STEPS and resumed.state.global_step == STEPS


# ---- issue 22 item 5: the steps a kill lost are charged ----------------------------------------------------------
def test_steps_computed_after_the_last_checkpoint_are_charged_on_resume(data, tmp_path):
    steps = 8
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, data, [KillAt(EVERY + 2)], max_steps=steps).train()
    resumed, result, log = _resume(tmp_path, data, max_steps=steps)
    assert "computed 2 noisy step(s) past it" in log
    plan = resumed.ledger.plan
    sigma, q = plan.phases[0].noise_multiplier, plan.phases[0].sample_rate
    computed = (EVERY + 2) + (steps - EVERY)  # 5 before the kill, then 5 more from checkpoint-3
    expected = compute_epsilon([(sigma, q, computed)], plan.target_delta, plan.accountant)
    assert result.metrics["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert result.metrics["epsilon"] > plan.planned_epsilon()
    saved = json.loads((tmp_path / f"checkpoint-{steps}" / "privacy_ledger.json").read_text())
    assert saved["recomputed_steps"] == [[EVERY + 1, EVERY + 2]] and saved["steps_done"] == steps
    assert saved["history"] == [[sigma, q, computed]] and saved["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert PrivacyLedger.load(str(tmp_path / f"checkpoint-{steps}")).epsilon() == pytest.approx(expected, rel=1e-9)

    # killed again after a resumed step: both losses are charged, whichever checkpoint is resumed
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path / "twice", data, [KillAt(EVERY + 1)], max_steps=steps).train()
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path / "twice", data, [KillAt(EVERY + 2)], max_steps=steps).train(resume_from_checkpoint=True)
    again, _, _ = _resume(tmp_path / "twice", data, max_steps=steps)
    assert again.ledger.recomputed_steps == ((4, 4), (4, 5))


def test_an_uninterrupted_run_writes_no_recomputed_steps(data, tmp_path):
    _trainer(tmp_path, data, max_steps=EVERY).train()
    saved = json.loads((tmp_path / f"checkpoint-{EVERY}" / "privacy_ledger.json").read_text())
    assert "recomputed_steps" not in saved and saved["history"][0][2] == EVERY


# ---- item 5: a changed argument on resume is named, and refused or ignored -------------------------------------
def test_a_changed_argument_on_resume_is_named_and_refused_or_ignored(data, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, data, [KillAt(EVERY + 1)]).train()
    with pytest.raises(DPConfigError) as e:
        _trainer(tmp_path, data, max_steps=8).train(resume_from_checkpoint=True)
    assert "max_steps 6 → 8 changes the privacy plan: refused" in str(e.value)
    assert "Phase(" not in str(e.value)
    with pytest.raises(DPConfigError, match="trainable_blocks None → 1 changes what trains"):
        _trainer(tmp_path, data, trainable_blocks=1).train(resume_from_checkpoint=True)

    resumed, _, log = _resume(tmp_path, data, learning_rate=5e-4, warmup_steps=2)
    assert "learning_rate 0.001 → 0.0005: ignored on resume" in log
    assert "warmup_steps 0 → 2: ignored on resume" in log
    assert resumed.args.learning_rate == 1e-3 and resumed.args.warmup_steps == 0
    # the checkpoint's linear schedule went on: lr after the last step is 1e-3 · (1 - 6/6)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    assert set(resumed.lr_scheduler.base_lrs) == {1e-3}


# ---- item 2: output_dir checked before any work; refusals write nothing -----------------------------------------
def test_a_refusal_writes_nothing(data, tmp_path):
    out = tmp_path / "new" / "run"
    trainer = _trainer(out, data.select(range(8)))  # batch 16 > 8 examples
    with pytest.raises(DPConfigError, match="exceeds the 8 training examples"):
        trainer.train()
    assert not (tmp_path / "new").exists()


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A folder the OS refuses to write in: chmod 555, or for root (who writes through permissions) chattr +i; where
    neither works, the refusal a read-only mount gives (EROFS) from the probe's file creation in that folder."""
    folder = tmp_path / "ro"
    folder.mkdir()
    undo = None
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)]).returncode == 0:
        undo = ["chattr", "-i", str(folder)]
    else:
        import errno
        import tempfile

        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if dir is not None and os.path.abspath(dir).startswith(str(folder)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
            return real_mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    yield folder
    if undo:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("below", [False, True])
def test_a_read_only_output_dir_is_refused_before_any_work(below, data, read_only_dir):
    out = read_only_dir / "run" if below else read_only_dir
    with pytest.raises(OutputDirError, match="output_dir .* cannot be written") as e:
        _trainer(out, data)
    assert isinstance(e.value, OSError) and str(out) in str(e.value)
    assert list(read_only_dir.iterdir()) == []


# ---- item 3: a recipe rerun in a folder with checkpoints resumes, or starts afresh when told ---------------------
def test_a_recipe_rerun_resumes_its_checkpoints_or_overwrites_when_told(tmp_path, caplog):
    from hf_dp_repr.scripts import image_classification as recipe

    def argv(max_steps=4):
        return ["--output_dir", str(tmp_path), "--public_fraction", "0", "--max_train_samples_per_class", "8",
                "--max_eval_samples", "16", "--noise_multiplier", "1", "--target_delta", "1e-3", "--accountant", "rdp",
                "--max_steps", str(max_steps), "--per_device_train_batch_size", "16", "--save_strategy", "steps",
                "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true"]

    recipe.main(argv())
    weights = (tmp_path / "checkpoint-4" / "model.safetensors").read_bytes()
    ledger = (tmp_path / "checkpoint-4" / "privacy_ledger.json").read_text()

    with caplog.at_level("WARNING"):
        recipe.main(argv())  # the finished run is found and resumed: nothing trains, nothing is overwritten
    assert f"resuming from {tmp_path / 'checkpoint-4'}" in caplog.text and "nothing to resume" in caplog.text
    assert (tmp_path / "checkpoint-4" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "checkpoint-4" / "privacy_ledger.json").read_text() == ledger

    with pytest.raises(DPConfigError, match="max_steps 4 → 6 changes the privacy plan: refused"):
        recipe.main(argv(max_steps=6))

    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-10")  # an earlier run's, to be deleted
    recipe.main(argv() + ["--overwrite_output_dir", "true"])  # afresh: new noise, new weights
    assert (tmp_path / "checkpoint-4" / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "all_results.json").read_text())["eval_loss"]))


# ---- a killed run resumed spends the same ε; what is saved is a plain HF model --------------------------------------
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
