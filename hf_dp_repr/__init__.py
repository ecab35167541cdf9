"""hf-dp-repr: differentially private fine-tuning of Hugging Face models, and what DP noise does to their
representations.

The package follows the pipeline, one folder per stage, each importing only the stages before it: `data` → `scope`
→ `privacy` → `hub` → `training` → `analysis` → `audit`, `tuning` → `scripts` (and `cli`). The classes and
functions below load on first use (PEP 562), so `import hf_dp_repr` imports neither torch nor transformers, and
when torch is not loaded yet it sets OMP_WAIT_POLICY=PASSIVE (unless set; `hf_dp_repr.entry_point`: spinning
OpenMP threads made training up to 12× slower on a shared CPU); the entry points set up the process first and
`hf-dp-repr privacy` loads only the accountant.
"""

__version__ = "0.1.0"

import importlib

from .entry_point import passive_openmp_at_import
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    AuditDataError,
    CheckpointMismatchError,
    DataError,
    DPConfigError,
    HfDpReprError,
    HubAccessError,
    LedgerError,
    MissingColumnError,
    ModelFileError,
    NotPrivatizableError,
    OutOfReachError,
    OutputDirError,
    PrivacyBudgetExhaustedError,
    ProcessGroupError,
    RecipeArgumentError,
    ScopeError,
    TuningDataError,
    UnsupportedError,
)
from .quiet import silence_known_noise
from .training.hp_search.backends import register_search_backend

passive_openmp_at_import()  # OMP_WAIT_POLICY=PASSIVE before torch loads (entry_point.py): the quick start is fast
silence_known_noise()  # warnings that ask for no action, by message only (see quiet.py)
# DPTrainer.hyperparameter_search(backend="optuna"): tuning's search, imported at its first use (training imports
# nothing of tuning)
register_search_backend("optuna", "hf_dp_repr.tuning.search:run_search")

_LAZY = {"DPTrainer": "training.trainer", "DPTrainingArguments": "training.arguments",
         "ModelCardInfo": "hub.card", "PrivacyLedger": "privacy.ledger", "PrivacyPlan": "privacy.ledger",
         "calibrate_noise_multiplier": "privacy.accounting", "compute_epsilon": "privacy.accounting"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["DPTrainer", "DPTrainingArguments", "ModelCardInfo", "PrivacyLedger", "PrivacyPlan",
           "calibrate_noise_multiplier", "compute_epsilon", "HfDpReprError", "DPConfigError", "NotPrivatizableError",
           "ScopeError", "OutOfReachError", "TuningDataError", "PrivacyBudgetExhaustedError", "CheckpointMismatchError",
           "OutputDirError", "HubAccessError", "ProcessGroupError", "AuditDataError", "ModelFileError", "ArgumentError",
           "ArgumentTypeError", "RecipeArgumentError", "DataError", "MissingColumnError", "LedgerError",
           "UnsupportedError"]
