"""What a recipe checks before any work (public pre-training, feature caching, training) and before anything is
written: the DP arguments, the model's fine-tuning scope, the privacy plan for the private set, and the label set.

A bad argument costs seconds, not the minutes of public pre-training it used to come after, and leaves the output
folder untouched. Each error names the argument and the fix.
"""

from __future__ import annotations

import logging

from hf_dp_repr.errors import RecipeArgumentError

logger = logging.getLogger("hf_dp_repr.recipes")

CLASSIFIER_SUFFIXES = ("ForImageClassification", "ForSequenceClassification")


def check_before_work(model, train, training_args):
    """Run every check DPTrainer and the privacy plan would run later, now: positive batch sizes and schedule, the
    trainable scope (`--trainable_blocks` against the model's block count), that the model can be trained with DP-SGD,
    and the privacy plan (`plan_run`: logical batch ≤ n, σ calibrated for the target ε) on the `train` (private) set.

    Returns the plan (a frozen `PrivacyPlan`). Writes nothing."""
    from hf_dp_repr.privacy.validation import check_delta, check_model_is_privatizable
    from hf_dp_repr.scope.phases import phase_scopes
    from hf_dp_repr.training.plan import plan_run

    args = training_args
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if int(getattr(args, name)) < 1:
            raise RecipeArgumentError(f"--{name} {getattr(args, name)}: must be >= 1 (the logical batch is "
                                      "per_device_train_batch_size × gradient_accumulation_steps × processes).")
    if args.lp_per_device_train_batch_size is not None and args.lp_per_device_train_batch_size < 1:
        raise RecipeArgumentError(f"--lp_per_device_train_batch_size {args.lp_per_device_train_batch_size}: must be "
                                  ">= 1 (or left unset).")
    if args.max_steps <= 0 and not args.num_train_epochs > 0:
        raise RecipeArgumentError(f"--num_train_epochs {args.num_train_epochs} plans no DP step: give a positive "
                                  "--num_train_epochs or --max_steps.")
    if args.gradient_checkpointing and not (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        raise RecipeArgumentError(
            "--gradient_checkpointing: the default (non-reentrant) checkpointing hides the activations Opacus needs, "
            "so no per-example gradient is computed. Add --gradient_checkpointing_kwargs '{\"use_reentrant\": true}', "
            "or drop it and save memory with a smaller --per_device_train_batch_size and more "
            "--gradient_accumulation_steps (same logical batch, same privacy).")
    if len(train) == 0:
        raise RecipeArgumentError("the private training set is empty: lower --public_fraction or check the dataset.")
    check_model_is_privatizable(model)
    phase_scopes(model, args.trainable_blocks, args.lp_steps, args.block_stack,  # ScopeError names the block count
                 args.trainable_groups)
    n = private_count(train, args)  # units are counted (and missing ids refused) now, not after pre-training
    if not args.allow_large_delta:  # allowed: DPTrainer warns once, later
        check_delta(args.target_delta, n, "examples" if args.privacy_unit == "row" else "units")
    plan = plan_run(args, n)
    if plan.planned_steps < 1:
        raise RecipeArgumentError(f"the schedule plans {plan.planned_steps} DP steps; raise --num_train_epochs or "
                                  "--max_steps.")
    return plan


def private_count(train, training_args) -> int:
    """n of the privacy plan: the private rows, or the units they hold (distinct values of `--privacy_unit`)."""
    if training_args.privacy_unit == "row":
        return len(train)
    from hf_dp_repr.privacy.units import column_values, unit_rows

    return unit_rows(column_values(train, training_args.privacy_unit))[1]


# ---- label sets --------------------------------------------------------------------------------------------------
def class_names(train, label_col: str, num_labels: int | None = None, model_id2label: dict | None = None,
                others=()) -> tuple[int, dict[int, str]]:
    """(number of classes, id2label), declared rather than read off the (private) labels: the dataset's ClassLabel
    feature, else `--num_labels`, else the label set of a model that already is a classifier (`model_id2label`).
    Every label of `train` and `others` (eval splits) must lie in the declared range."""
    names = getattr(train.features.get(label_col), "names", None)
    flag = "--num_labels"
    if names:
        if num_labels is not None and num_labels != len(names):
            raise RecipeArgumentError(f"{flag} {num_labels}, but the dataset's ClassLabel column {label_col!r} "
                                      f"declares {len(names)} classes; drop {flag}.")
        id2label = dict(enumerate(names))
    elif num_labels is not None:
        if num_labels < 2:
            raise RecipeArgumentError(f"{flag} {num_labels}: a classifier needs at least 2 classes.")
        id2label = {i: str(i) for i in range(num_labels)}
    elif model_id2label:
        id2label = {int(k): v for k, v in model_id2label.items()}
        logger.warning("label set taken from the model's config: %d classes (%s...)", len(id2label),
                       ", ".join(list(id2label.values())[:3]))
    else:
        raise RecipeArgumentError(
            f"the label column {label_col!r} is not a ClassLabel, so the number of classes would be read off the "
            f"labels themselves (private data). Declare it: pass {flag} N (classes 0..N-1), or cast the column to a "
            "datasets.ClassLabel.")
    n = len(id2label)
    for split in (train, *others):
        labels = split[label_col]
        bad = [y for y in set(int(v) for v in labels) if not 0 <= y < n]
        if bad:
            raise RecipeArgumentError(f"label(s) {sorted(bad)[:5]} in column {label_col!r} are outside the declared "
                                      f"{n} classes (0..{n - 1}); fix the data or pass the right {flag}.")
    return n, id2label


def model_config_labels(name_or_path: str) -> dict | None:
    """id2label of a saved model that already is a classifier (its config's architectures say so), else None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None
    if any(a.endswith(CLASSIFIER_SUFFIXES) for a in (config.architectures or [])):
        return dict(config.id2label)
    return None
