"""DPTrainer.hyperparameter_search runs a registered backend; the trainer imports nothing of tuning, whose Optuna
search the root package registers as "optuna" (loaded at its first use); run hooks see every train()."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.hp_search.backends import SEARCH_BACKENDS, register_search_backend

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_training_run_imports_nothing_of_tuning(tmp_path):
    code = ("import sys\n"
            "from hf_dp_repr import DPTrainer, DPTrainingArguments\n"
            "from hf_dp_repr.data import load_digits_dataset\n"
            "from hf_dp_repr.tiny import tiny_vit\n"
            f"args = DPTrainingArguments(output_dir={str(tmp_path)!r}, max_steps=1, per_device_train_batch_size=8, "
            "noise_multiplier=1.0, report_to='none', save_strategy='no', disable_tqdm=True)\n"
            "DPTrainer(model=tiny_vit(), args=args, train_dataset=load_digits_dataset()['train'].select(range(32)))"
            ".train()\n"
            "print(sorted(m for m in sys.modules if m.startswith('hf_dp_repr.tuning')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _trainer(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                               noise_multiplier=1.0, report_to="none", save_strategy="no", disable_tqdm=True)
    return DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(32)))


def test_an_unknown_backend_is_refused_naming_the_registered_ones(digits, tmp_path):
    with pytest.raises(ValueError, match=r"backend='ray'; .* are \[.*'optuna'.*\]"):
        _trainer(digits, tmp_path).hyperparameter_search(backend="ray", n_trials=1)


def test_a_registered_backend_runs_and_its_run_hooks_see_each_train(digits, tmp_path, monkeypatch):
    seen = []

    def backend(trainer, hp_space, compute_objective, n_trials, direction, hp_name, *rest, **kwargs):
        trainer.run_hooks.append(lambda t, state: seen.append((t, state, t.ledger.steps_done)))
        trainer.train()
        return "done"

    monkeypatch.setitem(SEARCH_BACKENDS, "test", None)  # removed again after the test
    register_search_backend("test", backend, replace=True)
    trainer = _trainer(digits, tmp_path)
    assert trainer.hyperparameter_search(backend="test", tuning_data="public") == "done"
    assert seen == [(trainer, "complete", 1)]
