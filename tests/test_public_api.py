"""The package root names the API a user's script needs, and nothing else; importing it still sets up the process."""

import subprocess
import sys

import hf_dp_repr

API = {"DPTrainer", "DPTrainingArguments", "ModelCardInfo", "PrivacyLedger", "PrivacyPlan", "accuracy_metrics",
       "calibrate_noise_multiplier", "compute_epsilon", "HfDpReprError"}


def test_the_root_exports_the_api_only():
    assert set(hf_dp_repr.__all__) == API
    for name in API:
        assert getattr(hf_dp_repr, name) is not None
    leaked = {n for n in vars(hf_dp_repr) if not n.startswith("_")} - API
    submodules = {n for n in leaked if type(getattr(hf_dp_repr, n)).__name__ == "module"
                  and getattr(hf_dp_repr, n).__name__ == f"hf_dp_repr.{n}"}  # imported submodules are attributes
    assert leaked == submodules, leaked - submodules
    assert not {"importlib", "passive_openmp_at_import", "silence_known_noise", "register_search_backend",
                "ScopeError"} & set(dir(hf_dp_repr))


def test_importing_the_root_still_sets_up_the_process():
    code = ("import os, sys, warnings; import hf_dp_repr; "
            "from hf_dp_repr.training.hp_search.backends import SEARCH_BACKENDS; "
            "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE', 'openmp'; "
            "assert 'optuna' in SEARCH_BACKENDS, 'optuna backend'; "
            "assert any('no inputs require gradients' in str(f[1].pattern if f[1] else '') "
            "for f in warnings.filters), 'silenced'; "
            "assert 'torch' not in sys.modules, 'torch'")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
