"""Refuse, before anything is trained or written, models that DP-SGD cannot train privately."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from opacus.grad_sample.grad_sample_module import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import IterableDataset
from transformers.models.vit.modeling_vit import ViTEmbeddings

from .. import errors
from ..errors import DataError
from .sharding import base_type


def check_model_is_privatizable(model: nn.Module) -> None:
    """Raise `NotPrivatizableError` naming every offending module path and the fix."""
    problems = []
    for name, module in model.named_modules():
        path = name or "<root>"
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # Even frozen, BatchNorm in train mode mixes examples within a batch and stores private batch statistics.
            problems.append(
                f"{path} ({type(module).__name__}): batch statistics mix examples and leak through running stats. "
                "Fix: `model = opacus.validators.ModuleValidator.fix(model)` (replaces it with GroupNorm)."
            )
            continue
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if not trainable:
            continue
        validator = ModuleValidator.VALIDATORS.get(base_type(module))  # FSDP<Class> → Class
        for err in validator(module) if validator else []:
            problems.append(f"{path} ({type(module).__name__}): {err}. Fix: "
                            "`opacus.validators.ModuleValidator.fix(model)`.")
        if isinstance(module, ViTEmbeddings) and module.dropout.p > 0:
            problems.append(
                f"{path} (ViTEmbeddings): embedding dropout p={module.dropout.p} makes per-sample gradients of "
                "cls_token/position_embeddings inexact. Fix: set config.hidden_dropout_prob=0."
            )
    for err in GradSampleModule.validate(model, strict=False):
        problems.append(f"{err}. Fix: freeze that module (requires_grad=False) or replace it.")
    if problems:
        raise errors.NotPrivatizableError(
            "This model cannot be trained with DP-SGD as it is:\n  - " + "\n  - ".join(problems)
        )


def check_train_dataset(dataset, target_delta: float, count_units: Callable[[], int | None] | None = None,
                        allow_large_delta: bool = False) -> None:
    """A training set DP-SGD can sample and account for: map-style, non-empty, and δ < 1/n (n: rows, or the number
    of units of privacy that `count_units()` reads from the map-style dataset) unless `allow_large_delta`."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise DataError(
            "DPTrainer: train_dataset must have a length (a map-style dataset): Poisson sampling and the privacy "
            "accounting need n. Materialise the IterableDataset first (e.g. `Dataset.from_generator`)."
        )
    if len(dataset) == 0:
        raise DataError("DPTrainer: train_dataset is empty.")
    num_units = count_units() if count_units is not None else None
    n = len(dataset) if num_units is None else num_units
    check_delta(target_delta, n, "examples" if num_units is None else "units", allow_large_delta)


def check_delta(target_delta: float, n: int, what: str = "examples", allow_large_delta: bool = False) -> None:
    """Refuse δ ≥ 1/n for n training `what` (examples or units): such a δ allows releasing a few of them outright.
    `allow_large_delta` turns the refusal into a warning (the model card then states it)."""
    if target_delta < 1 / n:
        return
    message = (f"DPTrainer: target_delta={target_delta:g} is >= 1/n = {1 / n:.3g} for n={n} training {what}; such "
               f"a δ allows releasing a few {what} outright.")
    if not allow_large_delta:
        raise errors.DPConfigError(f"{message} Use δ < 1/n, e.g. target_delta={1 / (10 * n):.1e}, or set "
                                   "allow_large_delta=True to train anyway (the model card then says so).")
    warnings.warn(f"{message} Allowed by allow_large_delta=True; the model card states it.", stacklevel=4)


def check_one_row_per_example(batch: dict, n_examples: int) -> None:
    """Refuse a collated micro-batch of `n_examples` whose rows are not its examples: a tensor whose first
    dimension is not the number of examples, or position ids that restart inside a row. Both are packing (e.g.
    `DataCollatorWithFlattening`): examples sharing a row share one clipped gradient and see each other in
    attention, so removing one example could change the update by more than C."""
    fix = ("DP-SGD clips, samples and accounts per row: use one example per row with a padding collator "
           "(e.g. DataCollatorWithPadding, DataCollatorForLanguageModeling); no packing under DP-SGD.")
    for key, value in batch.items():
        shape = getattr(value, "shape", None)
        if shape is not None and (len(shape) == 0 or shape[0] != n_examples):
            raise DataError(f"DPTrainer: the collated batch's `{key}` has shape {tuple(shape)} for {n_examples} "
                            f"examples; its first dimension must be the number of examples. {fix}")
    positions = batch.get("position_ids")
    if positions is not None and getattr(positions, "ndim", 0) == 2 and positions.shape[1] > 1:
        restarts = positions[:, 1:] < positions[:, :-1]
        mask = batch.get("attention_mask")
        if mask is not None and getattr(mask, "shape", None) == positions.shape:
            restarts = restarts & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)  # left padding is not a restart
        if restarts.any():
            raise DataError(f"DPTrainer: `position_ids` restart inside a row: several examples are packed into one "
                            f"row. {fix}")

