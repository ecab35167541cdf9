"""Resuming a run whose checkpoint already finished its privacy plan: a no-op that says so.

Without this, the Trainer either fast-forwards past the last step and asks the ledger for one more noisy step
(which it refuses: "Privacy budget exhausted") or, at an epoch boundary, silently returns. Here the
checkpoint's plan is checked against the current arguments, its weights and state are restored (so
`evaluate()`/`save_model()` see the finished run), one message is logged, and no DP step is taken.
"""

from __future__ import annotations

import math
import os

from transformers import TrainerState
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from .plan import resume_ledger
from .privacy.ledger import PrivacyLedger

logger = logging.get_logger(__name__)


def is_finished(ledger: PrivacyLedger) -> bool:
    return ledger.steps_done >= ledger.plan.planned_steps


def finish_without_training(trainer, checkpoint: str, ledger: PrivacyLedger) -> TrainOutput:
    """Restore the finished run of `checkpoint` into `trainer` and return its `TrainOutput`, training nothing."""
    state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    trainer.ledger = resume_ledger(trainer.privacy_plan(), ledger, state.global_step)
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = state
    eps = trainer.epsilon()
    plan = ledger.plan
    logger.warning(
        f"DPTrainer: nothing to resume, {checkpoint} ends a finished run: all {plan.planned_steps} planned DP steps "
        f"are done (ε = {eps:.4f}, δ = {plan.target_delta:g}). No step taken, ε unchanged; the model holds the "
        "checkpoint's weights. To train further, plan a new run (with its own budget) from these weights."
    )
    return TrainOutput(state.global_step, math.nan, {"epsilon": eps, "epoch": state.epoch, "train_runtime": 0.0})
