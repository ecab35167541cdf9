"""Weight averaging of the DP iterates (`ema_decay`): what `DPTrainer` releases is the exponential moving average.

The average is post-processing of the noisy iterates (each is already released by DP-SGD's guarantee), so it
costs no ε and the privacy plan is unchanged. Convention: the average starts at the weights training starts from,
and after the t-th noisy step (t = 0, 1, ...) becomes

    avg ← d_t · avg + (1 − d_t) · θ_{t+1},    d_t = min(ema_decay, (1 + t) / (10 + t)),

the warm-up of TensorFlow's `ExponentialMovingAverage(num_updates=t)`: early averages forget the start quickly
(d_0 = 0.1), later ones average over about 1 / (1 − ema_decay) steps. Only the parameters the optimizer trains
(every phase's, e.g. LP→FT's head then blocks; a PEFT model's adapters) are averaged; frozen ones stay as they are.

What uses which weights:
- `evaluate`, `predict`, `save_model` (and so pushes and the model file of every checkpoint): the average;
- training steps: the raw DP iterate;
- a checkpoint also holds the raw iterate and the step count (`weight_average.pt`, never pushed: not a model file);
  resuming restores both exactly;
- after `train()` returns the model holds the average (the raw iterate stays in `trainer.weight_average.raw`);
  with `load_best_model_at_end`, the best checkpoint's average.

Sharded (FSDP2): the average is sharded as the parameters are (DTensors on their mesh and placements), and each
rank updates its own shard after every step; the update is elementwise, so this is the unsharded average exactly.
Saves and checkpoints gather it whole as they gather the model (every rank joins; rank 0 writes), the raw iterate
with it; a resume scatters both back into the shards.

Example:
    >>> import torch
    >>> from hf_dp_repr.training.averaging import WeightAverage
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> avg = WeightAverage(0.9, {"w": w})
    >>> with torch.no_grad():
    ...     _ = w.fill_(1.0)
    >>> avg.update()  # d_0 = min(0.9, 1/10) = 0.1
    >>> [round(v, 6) for v in avg.average["w"].tolist()]  # 0.1 · 0 + 0.9 · 1
    [0.9, 0.9]
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..errors import CheckpointMismatchError, DPConfigError
from ..privacy.sharding import reshard
from ..scope.shards import assign, whole
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)

AVERAGE_FILE = "weight_average.pt"  # in checkpoints only: the raw iterate and the count (`.pt`: not pushed)


def check_ema_decay(args) -> None:
    """`ema_decay`: None (off) or in [0, 1)."""
    decay = getattr(args, "ema_decay", None)
    if decay is None:
        return
    if not 0 <= decay < 1:
        raise DPConfigError(f"DPTrainingArguments: ema_decay={decay} must be in [0, 1) (e.g. 0.999), or None for "
                            "no weight averaging.")


def averaging_note(args) -> str:
    """What the model card's scope line adds: which weights are released."""
    decay = getattr(args, "ema_decay", None)
    if decay is None:
        return ""
    return (f"; released weights: the exponential moving average of the DP iterates (ema_decay={decay}, warm-up "
            "min(ema_decay, (1+t)/(10+t))), post-processing at no privacy cost")


def decay_at(decay: float, t: int) -> float:
    """The decay of the update after noisy step t (0-based): min(decay, (1 + t) / (10 + t))."""
    return min(decay, (1 + t) / (10 + t))


class WeightAverage:
    """The exponential moving average of `params` (name → live parameter), with the warm-up of `decay_at`."""

    def __init__(self, decay: float, params: dict[str, torch.nn.Parameter], settle=None):
        self.decay, self.params, self.updates = decay, params, 0
        self.average = {n: p.detach().clone() for n, p in params.items()}
        self.raw: dict[str, torch.Tensor] | None = None  # after `release`: the last raw iterate
        # called before values are copied into the parameters: a sharded model's modules drop the weights a forward
        # left gathered on them (FSDP2 with reshard_after_forward=False), which the next forward would use instead
        self.settle = settle or (lambda: None)

    @torch.no_grad()
    def update(self) -> None:
        """After a noisy step: fold the new iterate in."""
        weight = 1.0 - decay_at(self.decay, self.updates)
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach(), weight)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the live parameters for the duration; the raw iterate back afterwards."""
        raw = self._copy_in(self.average)
        try:
            yield
        finally:
            self._copy_in(raw)

    @torch.no_grad()
    def _copy_in(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.settle()
        before = {n: p.detach().clone() for n, p in self.params.items()}
        for name, p in self.params.items():
            p.copy_(values[name])
        return before

    def release(self) -> None:
        """The end of training: the live parameters hold the average from now on, the raw iterate is kept."""
        self.raw = self._copy_in(self.average)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(self, folder: str, write: bool = True) -> None:
        """The raw iterate, whole (gathered from the shards of a sharded model: every rank calls this), written when
        `write` (rank 0's job)."""
        raw = {n: whole(p).cpu().clone() for n, p in self.params.items()}
        if write:
            torch.save({"decay": self.decay, "updates": self.updates, "raw": raw}, os.path.join(folder, AVERAGE_FILE))

    @torch.no_grad()
    def restore(self, state: dict) -> None:
        """From a checkpoint whose model file (the average) is loaded in the live parameters: they become the
        average, and the raw iterate goes back into them."""
        raw = state["raw"]
        if set(raw) != set(self.params) or any(raw[n].shape != p.shape for n, p in self.params.items()):
            raise CheckpointMismatchError(
                f"DPTrainer: the checkpoint's weight average ({len(raw)} tensors) is not of what this run trains "
                f"({len(self.params)} tensors, same names and shapes); resume with the same scope, or start a new run.")
        self.average = {n: p.detach().clone() for n, p in self.params.items()}  # sharded as the parameters
        self.settle()
        for name, p in self.params.items():
            assign(p, raw[name])  # a DTensor: scattered into its shards (every rank calls this)
        self.updates = int(state["updates"])


def read_average(checkpoint: str, decay: float | None) -> dict | None:
    """The checkpoint's averaging state, or None; refused when it does not match `ema_decay` being set."""
    path = os.path.join(checkpoint, AVERAGE_FILE)
    state = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
    if (state is None) != (decay is None) or (state is not None and state["decay"] != decay):
        have = "no weight average" if state is None else f"a weight average (ema_decay={state['decay']})"
        raise CheckpointMismatchError(
            f"DPTrainer: {checkpoint} holds {have} but this run has ema_decay={decay}: its model file is "
            f"{'the raw iterate' if state is None else 'the average'}, not what this run would continue from. "
            "Resume with the ema_decay of the run that wrote it.")
    return state


class _UpdateAfterStep(TrainerCallback):
    """After every optimizer step (once per logical batch, after the update: Opacus' own step hook runs before it)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.weight_average is not None and self.trainer.weight_average.raw is None:
            self.trainer.weight_average.update()


def start_average(trainer) -> None:
    """With the DP optimizer made: average what it trains (again for every train(), or from a checkpoint read by
    `read_average`, left in `trainer._pending_average`)."""
    decay = trainer.args.ema_decay
    if decay is None:
        trainer.weight_average = None
        return
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    params = {n: p for n, p in trainer.model.named_parameters() if id(p) in trained}
    average = WeightAverage(decay, params, settle=(lambda: reshard(trainer.model)) if trainer.sharded else None)
    if trainer._pending_average is not None:
        average.restore(trainer._pending_average)
        trainer._pending_average = None
    trainer.weight_average = average
    if not any(isinstance(cb, _UpdateAfterStep) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(_UpdateAfterStep(trainer))


def averaged_weights(trainer):
    """The average in the model for the duration (evaluation, prediction, saving), while training still runs."""
    average = trainer.weight_average
    return contextlib.nullcontext() if average is None or average.raw is not None else average.swapped_in()


def is_averaging(trainer) -> bool:
    """Training runs with an average that is not yet released (a checkpoint then also holds the raw iterate)."""
    return trainer.weight_average is not None and trainer.weight_average.raw is None


def finish_average(trainer) -> None:
    """The end of train(): the model holds the average from now on."""
    if is_averaging(trainer):
        trainer.weight_average.release()
