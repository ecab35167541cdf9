"""Trainer hooks a DPTrainer subclass may override without effect, refused when the trainer is built.

DP-SGD needs one loss per example, so `DPTrainer.training_step` computes them with `per_example_loss(outputs,
labels)` and never calls `compute_loss` (the Trainer still calls it in evaluation, for `eval_loss`). A subclass
overriding `compute_loss` would train on another objective than the one it wrote, without a word: refused, naming
`per_example_loss`, the hook to override.

Only overrides that come before DPTrainer in the method resolution order count: in `class DPSFTTrainer(DPTrainer,
SFTTrainer)` TRL's `compute_loss` comes after DPTrainer's bases and is not the user's. A class whose
`compute_loss` is meant for evaluation only, its training loss being given by its `per_example_loss`, says so in
the class body that defines it with `compute_loss_handled = True` (inherited, it does not cover an override in a
further subclass).

    >>> from hf_dp_repr import DPTrainer
    >>> class Mine(DPTrainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
    >>> check_loss_overrides(Mine, DPTrainer)
    Traceback (most recent call last):
    hf_dp_repr.errors.DPConfigError: Mine overrides `compute_loss`, which DP-SGD training never calls: ...
    >>> class Declared(Mine):
    ...     compute_loss = Mine.compute_loss
    ...     compute_loss_handled = True  # the evaluation loss; per_example_loss gives the training one
    >>> check_loss_overrides(Declared, DPTrainer)
"""

from __future__ import annotations

from ..errors import DPConfigError


def check_loss_overrides(cls: type, base: type) -> None:
    """Refuse the `compute_loss` that `cls` resolves to when `cls` or a class between it and `base` (DPTrainer) in
    its MRO defines it, unless the body that defines it sets `compute_loss_handled = True`."""
    mro = cls.__mro__
    klass = next((k for k in mro[:mro.index(base)] if "compute_loss" in vars(k)), None)
    if klass is not None and not vars(klass).get("compute_loss_handled", False):
        raise DPConfigError(
            f"{klass.__qualname__} overrides `compute_loss`, which DP-SGD training never calls: it needs one loss "
            "per example, from `per_example_loss(outputs, labels)` (shape (batch,), unreduced), so the override "
            "would be silently ignored in training. Fix: override `per_example_loss` instead; if this "
            "compute_loss is meant for evaluation only and per_example_loss already gives its training loss, "
            f"set `compute_loss_handled = True` in the body of {klass.__qualname__}.")
