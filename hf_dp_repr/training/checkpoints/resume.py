"""Resuming a DP run from a checkpoint: which checkpoint, what may change, and what the interrupted run spent.

- Which: `resume_from_checkpoint=True` takes the newest complete checkpoint (`output_dir.last_complete_checkpoint`)
  and logs which it took and which it skipped.
- What may change: the privacy plan and what trains may not (each changed argument is named and refused); the
  optimizer and learning-rate schedule continue from the checkpoint (each changed argument is named, ignored and
  set back to the checkpoint's value); anything else (logging, evaluation, saving) applies from the resume on.
- What was spent: every noisy step counts, even one whose result a kill lost (its loss or eval metrics may have
  been logged). The run records its position in `<output_dir>/privacy_spent.json` after every step (atomically);
  a resume charges the steps that the run computed after the checkpoint (`PrivacyLedger.recomputed_steps`): they
  are computed again with fresh noise, so the final ε is the accountant's for every step computed, above the
  plan's by as much.
- A checkpoint that already finished its plan: a no-op that says so (without this, the Trainer either
  fast-forwards past the last step and asks the ledger for one more noisy step, which it refuses, or, at an epoch
  boundary, silently returns). Its weights and state are restored, so `evaluate()`/`save_model()` see the
  finished run, and no DP step is taken.
"""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerState
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from ...errors import ArgumentError, LedgerError
from ...privacy.ledger import LEDGER_FILE, PrivacyLedger, PrivacyPlan, write_atomically
from ..plan import continued_arguments, resume_ledger
from .output_dir import ARGS_FILE, TRAINER_STATE, last_complete_checkpoint

logger = logging.get_logger(__name__)

SPENT_FILE = "privacy_spent.json"


def checkpoint_to_resume(output_dir: str, resume_from_checkpoint: str | bool) -> str:
    """The checkpoint folder to resume from: the given one, or with `True` the newest complete one of output_dir."""
    if resume_from_checkpoint is True:
        path, skipped = last_complete_checkpoint(output_dir)
        if skipped:
            logger.warning(f"DPTrainer: skipping incomplete checkpoint(s) of {output_dir}: {', '.join(skipped)}.")
        if path is None:
            raise ArgumentError(f"DPTrainer: no complete checkpoint found in {output_dir} to resume from"
                                + (f" (incomplete: {', '.join(skipped)})." if skipped else "."))
    else:
        path = str(resume_from_checkpoint)
    logger.warning(f"DPTrainer: resuming from {path}.")
    return path


def prepare_resume(trainer, checkpoint: str) -> PrivacyLedger:
    """The ledger the resumed run continues: the checkpoint's, checked against the trainer's plan and arguments
    (refused with one line per change), charged with the steps computed after it by the run that wrote it. Sets
    the changed optimizer/schedule arguments back to the checkpoint's values, with a warning naming each."""
    try:
        ledger = PrivacyLedger.load(checkpoint)
    except FileNotFoundError:
        raise LedgerError(f"DPTrainer: checkpoint {checkpoint} has no {LEDGER_FILE}; resuming would lose the "
                          "privacy accounting. Resume only from checkpoints written by DPTrainer.") from None
    state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE))
    saved_args = _read_json(os.path.join(checkpoint, ARGS_FILE))  # None in checkpoints of older versions
    args = json.loads(trainer.args.to_json_string())
    resume_ledger(trainer.privacy_plan(), ledger, state.global_step, saved_args, args)
    if saved_args is not None:
        continued = continued_arguments(saved_args, args)
        for name in continued:
            setattr(trainer.args, name, saved_args[name])
        if continued:
            logger.warning(f"DPTrainer: arguments changed since {checkpoint}:\n  " + "\n  ".join(continued.values()))
    return charge_recomputed(ledger, read_spent(os.path.dirname(os.path.abspath(checkpoint))), checkpoint)


# ---- what the run computed: privacy_spent.json --------------------------------------------------------------
def write_spent(run_dir: str, ledger: PrivacyLedger) -> None:
    """Record the ledger's position (steps computed, steps computed again) in `run_dir`, atomically (safe from a
    kill; not flushed to disk, which would cost milliseconds per step). No ε: an accountant can take seconds."""
    os.makedirs(run_dir, exist_ok=True)
    record = {"steps_done": ledger.steps_done, "recomputed_steps": [list(r) for r in ledger.recomputed_steps],
              "plan": ledger.plan.to_dict()}
    write_atomically(os.path.join(run_dir, SPENT_FILE), json.dumps(record), durable=False)


def read_spent(run_dir: str) -> PrivacyLedger | None:
    """The position `write_spent` recorded in `run_dir` (None if there is none)."""
    path = os.path.join(run_dir, SPENT_FILE)
    try:
        d = _read_json(path)
        return None if d is None else PrivacyLedger(PrivacyPlan.from_dict(d["plan"]), int(d["steps_done"]),
                                                     tuple(tuple(r) for r in d["recomputed_steps"]))
    except (ValueError, TypeError, KeyError) as e:
        raise LedgerError(f"DPTrainer: {path} is unreadable ({type(e).__name__}: {e}); it says how many noisy steps "
                          "the interrupted run computed after its last checkpoint, which a resume must charge. "
                          "Never edit it; delete it only if you know the run stopped at a checkpoint.") from None


def charge_recomputed(ledger: PrivacyLedger, spent: PrivacyLedger | None, checkpoint: str) -> PrivacyLedger:
    """`ledger` (a checkpoint's) plus, as recomputed steps, those the run's record `spent` computed after it. Not
    with noise_seed: a step computed again from the same checkpoint then draws the same batch and the same noise,
    and releases nothing new."""
    if spent is None or ledger.plan.randomness == "seeded":
        return ledger
    lost = spent.steps_done - ledger.steps_done
    before = spent.recomputed_steps[:len(ledger.recomputed_steps)]
    if spent.plan != ledger.plan or lost < 0 or before != ledger.recomputed_steps:
        logger.warning(f"DPTrainer: {SPENT_FILE} next to {checkpoint} records another run ({spent.steps_done} steps "
                       "of its plan); the steps computed after this checkpoint by the run that wrote it are unknown "
                       "and not charged.")
        return ledger
    recomputed = spent.recomputed_steps + (((ledger.steps_done + 1, spent.steps_done),) if lost else ())
    if recomputed == ledger.recomputed_steps:
        return ledger
    charged = PrivacyLedger(ledger.plan, ledger.steps_done, recomputed, ledger.clip_norms)
    at_end = PrivacyLedger(ledger.plan, ledger.plan.planned_steps, recomputed).epsilon()
    logger.warning(
        f"DPTrainer: the run that wrote {checkpoint} computed {lost} noisy step(s) past it before it stopped "
        f"({len(recomputed)} interruption(s) in all); they are computed again now with fresh noise and charged "
        f"(recomputed_steps {[list(r) for r in recomputed]} in the ledger): ε so far {charged.epsilon():.4f}, at the "
        f"end of the plan {at_end:.4f} instead of the planned {ledger.plan.planned_epsilon():.4f}.")
    return charged


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


# ---- a finished run -------------------------------------------------------------------------------------------
def is_finished(ledger: PrivacyLedger) -> bool:
    return ledger.steps_done >= ledger.plan.planned_steps


def finish_without_training(trainer, checkpoint: str, ledger: PrivacyLedger) -> TrainOutput:
    """Restore the finished run of `checkpoint` into `trainer` and return its `TrainOutput`, training nothing."""
    state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE))
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
