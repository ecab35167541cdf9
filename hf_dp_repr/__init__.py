"""hf-dp-repr: differentially private fine-tuning of Hugging Face models, and what DP noise does to their representations."""

__version__ = "0.1.0"

from .config import DPTrainingArguments  # noqa: E402
from .errors import (CheckpointMismatchError, DPConfigError, HfDpReprError, HubAccessError,  # noqa: E402
                     ModelFileError, NotPrivatizableError, OutOfReachError, PrivacyBudgetExhaustedError, ScopeError)
from .quiet import silence_known_noise  # noqa: E402
from .privacy.accounting import calibrate_noise_multiplier, compute_epsilon  # noqa: E402
from .privacy.ledger import PrivacyLedger, PrivacyPlan  # noqa: E402
from .trainer import DPTrainer  # noqa: E402

silence_known_noise()  # warnings that ask for no action, by message only (see quiet.py)

__all__ = ["DPTrainer", "DPTrainingArguments", "PrivacyLedger", "PrivacyPlan", "calibrate_noise_multiplier",
           "compute_epsilon", "HfDpReprError", "DPConfigError", "NotPrivatizableError", "ScopeError", "OutOfReachError",
           "PrivacyBudgetExhaustedError", "CheckpointMismatchError", "HubAccessError", "ModelFileError"]
