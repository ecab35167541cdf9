"""hf-dp-repr: differentially private fine-tuning of Hugging Face models, and what DP noise does to their
representations.

The API a user's script needs is named here; everything else stays in its module (the typed errors in
`hf_dp_repr.errors`, the analyzers in `hf_dp_repr.analysis`, the TRL trainers in `hf_dp_repr.trl`, the data in
`hf_dp_repr.data`). The package follows the pipeline, one folder per stage, each importing only the stages before
it: `data` → `scope` → `privacy` → `hub` → `training` → `analysis` → `audit`, `tuning` → `scripts` (and `cli`).
The names below load on first use (PEP 562), so `import hf_dp_repr` imports neither torch nor transformers, and
when torch is not loaded yet it sets OMP_WAIT_POLICY=PASSIVE (unless set; `hf_dp_repr.entry_point`: spinning
OpenMP threads made training up to 12× slower on a shared CPU); the entry points set up the process first and
`hf-dp-repr privacy` loads only the accountant.

    >>> import hf_dp_repr
    >>> sorted(hf_dp_repr.__all__)[:3]
    ['DPTrainer', 'DPTrainingArguments', 'HfDpReprError']
"""

__version__ = "0.1.0"


def _set_up_the_process() -> None:
    """What importing the package does, beside naming the API (in a function: no helper name stays behind)."""
    from .entry_point import passive_openmp_at_import
    from .quiet import silence_known_noise
    from .training.hp_search.backends import register_search_backend

    passive_openmp_at_import()  # OMP_WAIT_POLICY=PASSIVE before torch loads (entry_point.py): the quick start is fast
    silence_known_noise()  # warnings that ask for no action, by message only (see quiet.py)
    # DPTrainer.hyperparameter_search(backend="optuna"): tuning's search, imported at its first use (training imports
    # nothing of tuning)
    register_search_backend("optuna", "hf_dp_repr.tuning.search:run_search")


_set_up_the_process()
del _set_up_the_process

# name → the module that defines it, imported at the name's first use
_LAZY = {"DPTrainer": "training.trainer", "DPTrainingArguments": "training.arguments",
         "ModelCardInfo": "hub.card", "PrivacyLedger": "privacy.ledger", "PrivacyPlan": "privacy.ledger",
         "calibrate_noise_multiplier": "privacy.accounting", "compute_epsilon": "privacy.accounting",
         "accuracy_metrics": "metrics", "HfDpReprError": "errors"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
