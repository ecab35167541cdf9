"""Checks of the accuracy arguments of `DPTrainingArguments` (issue 31): `ema_decay` (`training.averaging`),
`augmentation_multiplicity` (`privacy.augmentation`) and `probe_preconditioning` (`scope.preconditioning`). Each
refusal names the argument and the fix, before any work."""

from __future__ import annotations

import datasets
from transformers.utils import logging

from ..errors import DataError, DPConfigError
from ..scope.preconditioning import parse_preconditioning
from . import TRAINER_LOGGER
from .averaging import check_ema_decay

logger = logging.get_logger(TRAINER_LOGGER)


def check_accuracy_fields(args) -> None:
    """The arguments alone (from `DPTrainingArguments.__post_init__`)."""
    check_ema_decay(args)
    parse_preconditioning(args.probe_preconditioning)
    k = args.augmentation_multiplicity
    if not isinstance(k, int) or k < 1:
        raise DPConfigError(f"DPTrainingArguments: augmentation_multiplicity={k!r} must be an integer >= 1 (1: no "
                            "augmentation multiplicity; e.g. 8 or 16 views per example, as De et al. 2022).")
    if k > 1 and args.cache_features:
        raise DPConfigError("DPTrainingArguments: cache_features=True with augmentation_multiplicity > 1: each view "
                            "is a fresh random transform of the input, so what the frozen part computes differs per "
                            "view and step and cannot be cached; leave cache_features unset (None) or False.")


def check_views(args, dataset) -> int:
    """The number of views per example; refuses k > 1 on a `datasets.Dataset` without a transform (its k views
    would be k copies: k times the compute for the k = 1 update)."""
    k = args.augmentation_multiplicity
    if k > 1 and isinstance(dataset, datasets.Dataset) and dataset.format.get("type") != "custom":
        raise DataError(f"DPTrainer: augmentation_multiplicity={k} but the training set has no transform, so its "
                        f"{k} views of an example would be identical. Set the random augmentation on it "
                        "(train_dataset.set_transform(fn) or .with_transform(fn)), or set augmentation_multiplicity=1.")
    if k > 1:
        logger.info(f"DPTrainer: augmentation_multiplicity={k}: each sampled example is read {k} times through the "
                    "training set's transform; the mean of its views' gradients is clipped once (features are not "
                    "cached: each view differs).")
    return k
