"""The training set against the model, before any work: `DPTrainer` runs these at init and at the start of `train()`.

Without them a column named for another model (`image` / `label` where ViT's forward takes `pixel_values`) fails
inside the model after training started (`'NoneType' object has no attribute 'dtype'`), string labels vanish in the
collator ("the batch has no `labels`"), and a label outside the model's classes stops the first step with
`IndexError: Target 19 is out of bounds`. Here each names the column found and the fix (`rename_column`,
`class_encode_column`, `num_labels`).

What is checked, and what cannot be: the labels' type and range are read from the dataset (a `datasets.Dataset`'s
features and its label column; for other datasets, the type of the first row's label only: the range would mean
reading every row); the model's inputs are checked on the collated probe batch the trainer builds anyway, so a custom
collator that builds `pixel_values` from another column passes.

Example:
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> train = load_digits_dataset()["train"].rename_column("pixel_values", "image")
    >>> try:
    ...     check_batch_inputs(tiny_vit(), {"labels": None}, dataset_columns(train))
    ... except DPConfigError as err:
    ...     print(str(err).split(" (the Trainer")[0])  # doctest: +NORMALIZE_WHITESPACE
    DPTrainer: the training dataset has columns ['image', 'labels'] but ViTForImageClassification.forward takes
    pixel_values, labels, interpolate_pos_encoding, attention_mask, and the collated batch has no `pixel_values`
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import datasets

from ..data.images import takes_any_image_size
from ..errors import DPConfigError
from ..privacy.loss import is_causal_lm
from ..privacy.sampler import ExampleBatchCollator

LABELS = "labels"
LABEL_COLUMNS = (LABELS, "label", "label_ids")  # the default collators turn `label` / `label_ids` into `labels`
IGNORE_INDEX = -100  # a class label the loss skips


def base_model(model):
    """The model whose forward reads the batch (a PEFT model's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_inputs(model) -> list[str]:
    """The named parameters of the model's forward (its `**kwargs` left out)."""
    params = inspect.signature(base_model(model).forward).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def dataset_columns(dataset) -> list[str] | None:
    """A `datasets.Dataset`'s columns, or the keys of a map-style dataset's first row (None if rows are not dicts)."""
    if isinstance(dataset, datasets.Dataset):
        return list(dataset.column_names)
    try:
        row = dataset[0]
    except Exception:  # noqa: BLE001 - not indexable this way: nothing to report
        return None
    return list(row) if isinstance(row, Mapping) else None


def check_labels(model, dataset) -> None:
    """Refuse string labels, and class ids outside the model's `config.num_labels` (classifiers only)."""
    columns = dataset_columns(dataset) or []
    column = next((c for c in LABEL_COLUMNS if c in columns), None)
    if column is None:
        return  # reported on the collated batch (check_batch_inputs)
    is_arrow = isinstance(dataset, datasets.Dataset)
    feature = dataset.features[column] if is_arrow else None
    value = None if is_arrow else dataset[0][column]
    if (getattr(feature, "dtype", None) in ("string", "large_string")) or isinstance(value, str):
        fix = (f"`train_dataset = train_dataset.class_encode_column({column!r})` (a ClassLabel, ids 0..K-1 in sorted "
               "order of the names)" if is_arrow else "map each class name to an id 0..K-1 (or build a "
               f"datasets.Dataset and call `.class_encode_column({column!r})`)")
        raise DPConfigError(f"DPTrainer: the training dataset's `{column}` column holds strings; the model needs class "
                            f"ids (the collator drops strings, so the batch would have no `labels`). Encode them: "
                            f"{fix}, and load the model with num_labels=K (and id2label) to match.")
    classes = _num_classes(model)
    if classes is None or not is_arrow:
        return
    model_name = type(base_model(model)).__name__
    if isinstance(feature, datasets.ClassLabel):
        if feature.num_classes > classes:
            raise DPConfigError(f"DPTrainer: the training dataset's `{column}` is a ClassLabel of "
                                f"{feature.num_classes} classes but {model_name} has config.num_labels={classes}; "
                                "load the model with "
                                f"num_labels={feature.num_classes} (e.g. `from_pretrained(name, num_labels="
                                f"{feature.num_classes}, ignore_mismatched_sizes=True)`).")
        return
    if not isinstance(feature, datasets.Value) or not feature.dtype.startswith(("int", "uint")):
        return  # floats (regression, multi-label) or sequences (token labels): no class range
    import pyarrow.compute as pc

    labels = dataset.with_format("arrow")[column]
    labels = pc.filter(labels, pc.not_equal(labels, IGNORE_INDEX))
    low, high = (pc.min_max(labels)[k].as_py() for k in ("min", "max"))
    if high is not None and (high >= classes or low < 0):
        bad = high if high >= classes else low
        raise DPConfigError(f"DPTrainer: the training dataset's `{column}` holds class id {bad} but {model_name} has "
                            f"config.num_labels={classes} (ids 0..{classes - 1}); load the model with num_labels="
                            f"{max(high + 1, classes)}, or declare the classes with a ClassLabel column "
                            f"(`dataset.cast_column({column!r}, ClassLabel(names=...))`) and fix the labels outside "
                            "it.")


def check_train_inputs(trainer) -> None:
    """What `DPTrainer.train()` checks first: the labels, columns of which the Trainer would keep none, a padding
    collator without a pad token, then a collated probe batch of two rows (through the trainer's column removal and
    collator): one row per example (no packing), with the model's inputs, images of the model's size. A trainer whose
    `example_losses` reads other keys than the model's inputs and labels (TRL's) sets `batch_has_labels = False`."""
    labels = getattr(trainer, "batch_has_labels", True)
    columns = dataset_columns(trainer.train_dataset)
    if labels:
        check_labels(trainer.model, trainer.train_dataset)
        if trainer.args.remove_unused_columns and columns and not set(columns) & {*forward_inputs(trainer.model),
                                                                                 *LABEL_COLUMNS}:
            # the Trainer would drop every column and suggest remove_unused_columns=False: the fix is a rename
            check_batch_inputs(trainer.model, {}, columns, remove_unused_columns=True)
    check_pad_token(trainer.data_collator)
    dataset, collator = trainer._train_dataset_and_collator()
    batch = ExampleBatchCollator(collator)([dataset[i] for i in range(min(2, len(dataset)))])
    if labels:
        check_batch_inputs(trainer.model, batch, columns, trainer.args.remove_unused_columns)
    check_image_size(trainer.model, batch)


def check_pad_token(collator) -> None:
    """Refuse a padding collator (`DataCollatorWithPadding`, the Trainer's default with a tokenizer, ...) whose
    tokenizer has no pad token: transformers would stop at the first batch with 'Asking to pad'."""
    tokenizer = getattr(collator, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "pad_token") or tokenizer.pad_token is not None:
        return
    eos = getattr(tokenizer, "eos_token", None)
    raise DPConfigError(
        f"DPTrainer: the data collator ({type(collator).__name__}) pads, but the tokenizer "
        f"({type(tokenizer).__name__}) has no pad token. Fix: `tokenizer.pad_token = tokenizer.eos_token` "
        f"({eos!r}) and `model.config.pad_token_id = tokenizer.pad_token_id` (padded positions are masked), or "
        "tokenize to one fixed length and pass `data_collator=transformers.default_data_collator`.")


def check_image_size(model, batch: Mapping) -> None:
    """Refuse `pixel_values` of another size or channel count than the model's config (`image_size`,
    `num_channels`), naming both and the fix, instead of a reshape or position-embedding error mid-forward. A model
    that interpolates its position embeddings (DINOv2, or ViT through `data.images.interpolate_positions`, which
    `DPTrainer` installs: `data.images.takes_any_image_size`) takes any size."""
    config = getattr(base_model(model), "config", None)
    pixels = batch.get("pixel_values")
    size = getattr(config, "image_size", None)
    if pixels is None or size is None or getattr(pixels, "ndim", 0) != 4:
        return
    want = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    channels = getattr(config, "num_channels", None)
    got = tuple(pixels.shape[1:])
    if takes_any_image_size(model):
        want = got[1:]
    if got[1:] != want or (channels is not None and got[0] != channels):
        raise DPConfigError(
            f"DPTrainer: the training images are {got} (channels, height, width) but "
            f"{type(base_model(model)).__name__} takes {(channels, *want)} (config.num_channels, config.image_size). "
            "Fix: preprocess with the model's image processor (`AutoImageProcessor.from_pretrained(model_name)`, "
            f"which resizes to {want[0]}×{want[1]}), or load the model with image_size={got[1]} (and num_channels="
            f"{got[0]}) for a model trained from scratch.")


def check_batch_inputs(model, batch: Mapping, columns: list[str] | None, remove_unused_columns: bool = True) -> None:
    """Refuse a collated batch without the model's main input (e.g. `pixel_values`, `input_ids`) or without `labels`,
    naming the dataset's columns, what forward takes and the rename that fixes it."""
    base = base_model(model)
    takes = forward_inputs(model)
    # a transformers model names its main input; a plain nn.Module's batch needs one of its forward's inputs
    main = getattr(base, "main_input_name", None) or next((t for t in takes if t != LABELS), "input_ids")
    has_main = main in batch or "inputs_embeds" in batch or (
        not hasattr(base, "main_input_name") and any(k in takes and k != LABELS for k in batch))
    missing = [name for name, ok in ((main, has_main), (LABELS, LABELS in batch)) if not ok]
    if not missing:
        return
    name = missing[0]
    shown = columns if columns is not None else "that are not dicts"
    where = f"the training dataset has columns {shown}" if columns is not None else "the training rows are not dicts"
    unused = [c for c in columns or [] if c not in takes and c not in LABEL_COLUMNS]
    dropped = (f" (the Trainer drops the columns forward does not take: {unused})"
               if unused and remove_unused_columns else "")
    old = repr(unused[0]) if len(unused) == 1 else "'<column>'"
    what = "the model's input" if name == main else "the class ids / targets"
    processed = (" (holding the tensors the model's image processor makes, not raw images)"
                 if name == "pixel_values" else "")
    raise DPConfigError(
        f"DPTrainer: {where} but {type(base).__name__}.forward takes {', '.join(takes)}, and the collated batch has no "
        f"`{name}`{dropped}: rename the column that holds {what}: `train_dataset = train_dataset.rename_column({old}, "
        f"{name!r})`{processed}, or pass a data_collator that builds `{name}` (with remove_unused_columns=False).")


def _num_classes(model) -> int | None:
    """`config.num_labels` of a single-label classifier; None for causal LMs, regression and multi-label heads."""
    config = getattr(base_model(model), "config", None)
    if config is None or is_causal_lm(model):
        return None
    if getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
        return None
    return getattr(config, "num_labels", None)
