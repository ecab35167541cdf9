"""The errors hf-dp-repr raises on purpose, in one place (as Opacus keeps its own): catch `HfDpReprError` for any
of them, or one kind. Each subclasses the builtin it replaces, so `except ValueError` / `except RuntimeError`
written against earlier versions still catches it.

    >>> from hf_dp_repr import DPTrainingArguments
    >>> from hf_dp_repr.errors import DPConfigError
    >>> try:
    ...     DPTrainingArguments(output_dir="out", report_to="none")  # no target ε, attack rate or σ
    ... except DPConfigError as err:
    ...     print(type(err).__name__, isinstance(err, ValueError))
    DPConfigError True
"""


class HfDpReprError(Exception):
    """Base of every error hf-dp-repr raises on purpose."""


# ---- refused before any work (a ValueError: the arguments, the data or the model cannot work) ---------------
class ArgumentError(HfDpReprError, ValueError):
    """An argument of a function, class or command that cannot work (a value out of range, an unknown name, two
    that exclude each other); the message names the argument and the fix."""


class ArgumentTypeError(HfDpReprError, TypeError):
    """An argument of the wrong type (or an unknown keyword); the message names the argument and what it takes."""


class DPConfigError(ArgumentError):
    """A DP argument (DPTrainingArguments, a recipe argument, a privacy plan) that cannot work; the message names the
    argument and the fix."""


class RecipeArgumentError(DPConfigError):
    """A recipe argument (`hf-dp-repr train ...`, `recipes/*.py`) that cannot work; raised before any work is done."""


class NotPrivatizableError(DPConfigError):
    """The model has modules whose training would break the DP guarantee or its per-sample gradients."""


class ScopeError(DPConfigError):
    """The requested fine-tuning scope does not fit the model."""


class OutOfReachError(DPConfigError):
    """No σ makes the run spend as little as the target ε (below the accountant's floor)."""


class DataError(HfDpReprError, ValueError):
    """The data given cannot be used as it is (arrays of the wrong shape or with NaN, labels that do not match the
    features, an empty dataset, a corpus too small); the message says what to change."""


class MissingColumnError(DataError, KeyError):
    """A dataset or batch lacks the column the call needs (a KeyError, as a missing key always was)."""


class LedgerError(HfDpReprError, ValueError):
    """A run's record is missing or unreadable (its `privacy_ledger.json`, or the record of a public phase): what
    needs it (a push, a model card, a resume) would lose the statement of the guarantee, so it is refused."""


class AuditDataError(DataError):
    """The data given to a privacy audit cannot be what the audited run trained on (e.g. more "members" than the
    ledger's n): the attack's numbers would be about other examples."""


class TuningDataError(DPConfigError):
    """A hyperparameter search's `tuning_data` does not match its data: a public or held-out search on a private
    training set, or a DP run on the data a search tuned on."""


# ---- refused during or around a run (a RuntimeError: the state of the run or of the world) ----------------------
class PrivacyBudgetExhaustedError(HfDpReprError, RuntimeError):
    """Another noisy step would spend more than the planned budget: every planned DP step is done."""


class CheckpointMismatchError(HfDpReprError, RuntimeError):
    """The checkpoint's tensors do not fill the model exactly: resuming would train from other weights."""


class UnsupportedError(HfDpReprError, NotImplementedError):
    """Something valid that this version cannot do in this setting (several processes for public → private
    training, rows of varying length over cached states, -OO without docstrings); a RuntimeError, as before."""


class OutputDirError(HfDpReprError, OSError):
    """output_dir cannot be written (read-only, full, a file in the way): raised before any work."""


class HubAccessError(HfDpReprError, RuntimeError):
    """Not logged in, offline, or no write access to the repository: raised before anything is written or sent."""


class ProcessGroupError(HfDpReprError, RuntimeError):
    """Processes launched together (accelerate launch, torchrun, MPI) that do not form one run: each would be its
    own DP run on the same data. Raised before any work."""


class ModelFileError(HfDpReprError, OSError):
    """A model's files cannot be read (a truncated or corrupted weights file, a model neither on the Hub nor
    installed); the message names the file or model and the fix."""


__all__ = ["HfDpReprError", "ArgumentError", "ArgumentTypeError", "DPConfigError", "RecipeArgumentError",
           "NotPrivatizableError", "ScopeError", "OutOfReachError", "DataError", "MissingColumnError", "LedgerError",
           "AuditDataError", "TuningDataError", "PrivacyBudgetExhaustedError", "CheckpointMismatchError",
           "UnsupportedError", "OutputDirError", "HubAccessError", "ProcessGroupError", "ModelFileError"]
