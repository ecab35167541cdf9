"""Checks of `DPTrainingArguments` fields, one function per feature (the unit of privacy, the linear-probing phase,
feature caching), run by `DPTrainingArguments.__post_init__`; `check_privacy_unit` also by callers that set
`privacy_unit` after parsing (the causal-LM recipe). Each refuses before any work, naming the argument and the fix."""

from __future__ import annotations

from .errors import DPConfigError


def check_privacy_unit(args) -> None:
    """Refuse privacy_unit / max_rows_per_unit values and combinations that units do not support (also for callers
    that set `args.privacy_unit` after parsing, as the causal-LM recipe does)."""
    unit = args.privacy_unit
    if not isinstance(unit, str) or not unit:
        raise DPConfigError(f"DPTrainingArguments: privacy_unit={unit!r} must be 'row' or the name of a training-set "
                         "column (e.g. 'document_id').")
    if unit == "row":
        if args.max_rows_per_unit is not None:
            raise DPConfigError("DPTrainingArguments: max_rows_per_unit is set but privacy_unit='row' (one row per "
                             "unit). Set privacy_unit to the unit column or drop max_rows_per_unit.")
        return
    if args.max_rows_per_unit is not None and args.max_rows_per_unit < 1:
        raise DPConfigError(f"DPTrainingArguments: max_rows_per_unit={args.max_rows_per_unit} must be >= 1 (or None).")
    if not args.poisson_sampling:
        raise DPConfigError(f"DPTrainingArguments: privacy_unit={unit!r} needs poisson_sampling=True: units are drawn "
                         "by Poisson sampling (fixed-size shuffled batches of units are not implemented).")
    if args.cache_features:
        raise DPConfigError(f"DPTrainingArguments: cache_features=True with privacy_unit={unit!r}: cached linear-probe "
                         "features are per row and lose the unit column. Drop cache_features (the backbone then runs "
                         "each step).")


def validate_lp_fields(args) -> None:
    if args.lp_steps < 0:
        raise DPConfigError(f"DPTrainingArguments: lp_steps={args.lp_steps} must be >= 0 (0 = no linear-probing phase).")
    if not args.lp_steps:
        extra = [n for n in ("lp_epsilon_fraction", "lp_per_device_train_batch_size", "lp_learning_rate")
                 if getattr(args, n) is not None]
        if extra:
            raise DPConfigError(f"DPTrainingArguments: {', '.join(extra)} set but lp_steps=0: there is no linear-probing "
                             "phase. Set lp_steps (e.g. 0.2 for the first 20 % of the steps) or drop them.")
        return
    if args.trainable_blocks == 0:
        raise DPConfigError("DPTrainingArguments: lp_steps with trainable_blocks=0 would linear-probe twice. Set "
                         "trainable_blocks to the fine-tuning scope (None = all) or drop lp_steps.")
    if args.lp_steps >= 1 and args.lp_steps != int(args.lp_steps):
        raise DPConfigError(f"DPTrainingArguments: lp_steps={args.lp_steps}: a number of steps must be whole "
                         "(or < 1 for a fraction of the planned steps).")
    frac = args.lp_epsilon_fraction
    if frac is not None and not 0 < frac < 1:
        raise DPConfigError(f"DPTrainingArguments: lp_epsilon_fraction={frac} must be in (0, 1).")
    if frac is not None and args.target_epsilon is None:
        raise DPConfigError("DPTrainingArguments: lp_epsilon_fraction splits target_epsilon; set target_epsilon "
                         "(or drop lp_epsilon_fraction to use noise_multiplier in both phases).")
    if args.clipping == "per_layer":
        raise DPConfigError("DPTrainingArguments: clipping='per_layer' splits C over a fixed set of tensors, which "
                         "changes between the linear-probe and fine-tune phases. Use clipping='flat' or 'automatic'.")
    if args.lp_per_device_train_batch_size is not None and not args.poisson_sampling:
        raise DPConfigError("DPTrainingArguments: lp_per_device_train_batch_size needs poisson_sampling=True "
                         "(fixed-size shuffled batches cannot change size mid-run).")


def validate_cache_fields(args) -> None:
    for name in ("cache_features_max_memory_gb", "cache_features_max_disk_gb"):
        if not getattr(args, name) >= 0:
            raise DPConfigError(f"DPTrainingArguments: {name}={getattr(args, name)} must be >= 0 (GiB).")
    if args.cache_features and args.trainable_blocks is None:
        raise DPConfigError("DPTrainingArguments: cache_features=True with trainable_blocks=None: full fine-tuning has "
                         "no frozen part to cache. Set trainable_blocks=k (0 = linear probe) or leave "
                         "cache_features=None.")
