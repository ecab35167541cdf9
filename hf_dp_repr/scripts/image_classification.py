"""DP fine-tuning of an image classifier with `DPTrainer`, for `python` or `accelerate launch`.

Offline default (sklearn's digits, a 4-block ViT pre-trained non-privately on a public half of the training
split, then fine-tuned under DP on the disjoint private half):

    python recipes/dp_image_classification.py --output_dir out/digits-eps1 --target_epsilon 1 --target_delta 1e-4

Two CPU processes (gloo) or several GPUs:

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/dp_image_classification.py \
        --output_dir out/digits-ddp --target_epsilon 8 --target_delta 1e-4 --per_device_train_batch_size 64
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/dp_image_classification.py \
        --config recipes/configs/seed000_vit_cifar10_eps1.yaml --trainable_blocks 4

A Hub model and dataset (needs Hub access), pushed with its DP model card:

    accelerate launch recipes/dp_image_classification.py \
        --model_name_or_path google/vit-base-patch16-224-in21k --dataset_name cifar10 \
        --max_train_samples_per_class 100 --target_epsilon 1 --target_delta 1e-3 --trainable_blocks 4 \
        --analyze_representations --push_to_hub --hub_model_id me/vit-dp-eps1 --output_dir out/vit-eps1

`--model_name_or_path`: a Hub name, a local folder (`save_pretrained`), or a built-in tiny config (`tiny_vit`).
`--dataset_name`: `digits` (embedded), a folder written by `DatasetDict.save_to_disk`, or anything
`datasets.load_dataset` takes (Hub name, `imagefolder` folder). `--config file.yaml`: arguments from a file
(see recipes/configs/); the command line overrides it. Every DP option: `--help`.

Output folder: the model (plain HF, `from_pretrained` works), `privacy_ledger.json`, `README.md` (DP model
card), `all_results.json` (accuracy, ε), and with `--analyze_representations` `representation_law.json` + plot.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from hf_dp_repr.data import DIGITS, load_embedded
from hf_dp_repr.data.images import (
    augment_images,
    image_processor_for,
    interpolate_positions,
    load_npz,
    per_class_indices,
    read_index_file,
    shift_images,
    takes_any_image_size,
    to_pixel_values,
)
from hf_dp_repr.data.model_files import explained_load_errors
from hf_dp_repr.data.user_data import check_column, encode_labels
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.metrics import accuracy_metrics
from hf_dp_repr.scope.preconditioning import parse_preconditioning
from hf_dp_repr.scripts import checks, dp_defaults, recipe_report
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import AnalysisArguments, ClassificationArguments, PublicPretrainingArguments
from hf_dp_repr.training.arguments import DPTrainingArguments
from hf_dp_repr.training.trainer import DPTrainer

logger = logging.getLogger("hf_dp_repr.recipes.image")


@dataclass
class ImageArguments(AnalysisArguments, PublicPretrainingArguments, ClassificationArguments):
    """Model and data of the image recipe (the shared fields: `hf_dp_repr.scripts.arguments`)."""

    model_name_or_path: str = field(default="tiny_vit", metadata={
        "help": "Hub name (google/vit-base-patch16-224-in21k), local folder, or built-in tiny config (tiny_vit)."})
    dataset_name: str = field(default=DIGITS, metadata={
        "help": "'digits' (embedded, offline), a .npz of image arrays, a save_to_disk folder, or a "
                "datasets.load_dataset name/folder."})
    image_column: str | None = field(default=None, metadata={
        "help": "Image column (default: the first of pixel_values, image, img)."})
    max_train_samples_per_class: int | None = field(default=None, metadata={
        "help": "Keep this many training images per class, chosen with --seed by the rule of hf_dp_repr.data.images "
                "(per class, ascending: numpy default_rng(seed).permutation of its rows, the first N)."})
    train_indices_file: str | None = field(default=None, metadata={
        "help": "Train on exactly these rows of the training split: a file of row numbers, one per line (# comments), "
                "e.g. recipes/configs/cifar10_partial_100_per_class.txt."})
    image_processor: str | None = field(default=None, metadata={
        "help": "Image processor (Hub name or folder) to preprocess with; default: the model's own, else the model "
                "family's known defaults (DINOv2: ImageNet mean/std, 224 px)."})
    image_size: int | None = field(default=None, metadata={
        "help": "Resize images to this many pixels square (default: the image processor's or the family's)."})
    image_mean: list[float] | None = field(default=None, metadata={
        "help": "Per-channel normalisation mean, e.g. 0.485 0.456 0.406 (default: the image processor's or the "
                "family's)."})
    image_std: list[float] | None = field(default=None, metadata={
        "help": "Per-channel normalisation std, e.g. 0.229 0.224 0.225 (default: the image processor's or the "
                "family's)."})
    public_dataset_name: str | None = field(default=None, metadata={
        "help": "PUBLIC images (a Hub name, an imagefolder or data files, read as --dataset_name is; labels unused) "
                "that precondition a pretrained model's linear probe: the DP-aware defaults then standardise the "
                "head's inputs with their per-feature mean and std (probe_preconditioning), fitted without DP and "
                "shipped in the saved head. Never pass private images here."})
    public_split: str = field(default="train", metadata={"help": "The split of --public_dataset_name to read."})
    public_max_samples: int | None = field(default=None, metadata={
        "help": "Read at most this many images of --public_dataset_name (the first ones)."})
    validation_fraction: float = field(default=0.0, metadata={
        "help": "Evaluate on this share of the private training rows, held out from training, instead of the eval "
                "split: choose settings on it, never on the test split. Its metrics are computed on private data "
                "outside DP-SGD, and choosing settings by them is not covered by the reported ε."})
    train_augmentation: str = field(default="none", metadata={
        "help": "A random transform of the private training images only, drawn anew at every read (what "
                "augmentation_multiplicity=k averages k views of): none, random_shift (each image moved by up to one "
                "pixel along each axis; hf_dp_repr.data.images.TRAIN_AUGMENTATIONS). Turns off feature caching of "
                "the linear probe, so the run is slower."})


ARGUMENT_TYPES = (ImageArguments, DPTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (accuracy, ε, ...)."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    targs.remove_unused_columns = False  # the collator below picks the columns
    model_name = margs.model_name_or_path
    public_rows = load_public_rows(margs)  # checked before any work: --public_dataset_name, its split and column
    public_fraction = margs.resolved_public_fraction(ru.is_tiny(model_name), ru.dataset_name(margs) == DIGITS,
                                                     model_name)

    data, image_col, label_col, data_notes = load_image_data(margs, targs.seed)
    source = data["train"]._fingerprint  # the training split as selected, before preprocessing and splitting
    num_labels, id2label = checks.class_names(
        data["train"], label_col, margs.num_labels, others=[data["eval"]],
        model_id2label=None if ru.is_tiny(model_name) else checks.model_config_labels(model_name))
    model = _load_model(model_name, num_labels, id2label, data["train"], image_col, targs.seed)
    interpolate_positions(model)  # a ViT at another --image_size (data.images; DPTrainer would, after the defaults)
    data, processor = _with_pixel_values(data, margs, model, image_col, label_col)
    collate = _collate

    train, public, data["eval"] = split_private(data, margs, public_fraction, targs.seed)
    train = augment_images(train, margs.train_augmentation)  # after the split: evaluation and public rows stay as is
    blank = data_free_images(processor, model.config.num_channels, train[0]["pixel_values"])
    defaults = dp_defaults.fill_in(targs, len(train), margs.given_options, margs.dp_defaults, model, blank,
                                   public_data=public_rows is not None)
    if public_rows is not None and parse_preconditioning(targs.probe_preconditioning)[0] == "none":
        raise RecipeArgumentError(f"--public_dataset_name {margs.public_dataset_name}: its images precondition a "
                                  "linear probe (--probe_preconditioning standardize or pca:K), which this run does "
                                  "not train; drop --public_dataset_name, or drop the scope/--probe_preconditioning "
                                  "none you gave.")
    public_images = public_pixel_values(public_rows, margs, processor, model.config.num_channels)
    plan = checks.check_before_work(model, train, targs)  # before any work and before anything is written
    recipe_report.default_logging(targs, plan.planned_steps, margs.given_options)
    if public is not None:
        save_dir = margs.public_model_dir or os.path.join(targs.output_dir, "public_pretrained")
        signature = dict(model=model_name, dataset=ru.dataset_name(margs) or margs.train_file, split=margs.train_split,
                         fraction=public_fraction, shift=margs.public_shift,
                         classes=margs.public_classes, seed=targs.seed,
                         epochs=margs.public_epochs,
                         lr=margs.public_learning_rate, batch=margs.public_batch_size,
                         per_class=margs.max_train_samples_per_class, indices=margs.train_indices_file)
        path = ru.pretrain_on_public(model, public, save_dir=save_dir, training_args=targs,
                                     epochs=margs.public_epochs, learning_rate=margs.public_learning_rate,
                                     batch_size=margs.public_batch_size, signature=signature,
                                     data_collator=collate, log=logger.info)
        model = type(model).from_pretrained(path)  # the path a Hub name takes

    callbacks = []
    if margs.analyze_representations:
        from hf_dp_repr.analysis import RepresentationLawCallback

        callbacks.append(RepresentationLawCallback(data["eval"], max_examples=margs.analysis_max_examples))

    card_info = ModelCardInfo(
        model_name=f"{model_name} fine-tuned on {ru.data_description(margs)}",
        base_model=None if ru.is_tiny(model_name) else model_name,
        base_model_description=(f"{model_name} (built-in tiny config, random init), pre-trained here on the public "
                                "data" if ru.is_tiny(model_name) and public else model_name),
        datasets=ru.hub_datasets(margs),
        private_data=f"{len(train)} examples of the '{margs.train_split}' split of {ru.data_description(margs)}"
                     + (f" (the {1 - public_fraction:.0%} not used as public data)" if public else "")
                     + "".join(f"; {note}" for note in data_notes),
        public_data=(f"{len(public)} other examples of the same split, disjoint from the private ones"
                     + (f", of classes {margs.public_classes} only" if margs.public_classes else "")
                     + ("" if margs.public_shift == "none" else f", shifted to another distribution "
                        f"({margs.public_shift})") + f", used for non-private pre-training of the randomly "
                     f"initialised {model_name}" if public is not None else
                     f"the pre-trained weights of {model_name} (not trained on the private data here)"
                     + (f"; {len(public_images)} images of {margs.public_dataset_name} ('{margs.public_split}' split, "
                        f"labels unused), whose statistics precondition the probe "
                        f"(probe_preconditioning={targs.probe_preconditioning!r}, fitted without DP, folded into the "
                        "saved head)" if public_images is not None else "")),
        analysis_data=(f"{len(data['eval'])} private training rows held out as validation (not trained on)"
                       if margs.validation_fraction else
                       f"the '{margs.eval_split}' split ({len(data['eval'])} examples, not trained on)"),
    )
    # probe_preconditioning's statistics come from the public images (no public phase: public_max_steps stays 0)
    stats_source = (public_images if public_images is not None else public) \
        if parse_preconditioning(targs.probe_preconditioning)[0] != "none" else None
    trainer = DPTrainer(model=model, args=targs, train_dataset=train, eval_dataset=data["eval"],
                        data_collator=collate, compute_metrics=accuracy_metrics(), callbacks=callbacks,
                        processing_class=processor, model_card_info=card_info,  # saved with the model
                        public_train_dataset=stats_source)
    trainer.plan_notes = recipe_report.plan_notes(data_notes, defaults)
    result = ru.train(trainer, margs.overwrite_output_dir)
    split = ru.split_record("image", source, public_fraction, targs.seed, len(train), len(data["eval"]))
    return ru.finish_run(trainer, result, margs, push=push, split=split)


def split_private(data: dict, margs: ImageArguments, public_fraction: float, seed: int):
    """(private training set, public set or None, evaluation set) from the recipe's {"train", "eval"} data: the
    public part split off with `seed` (shifted, restricted to `--public_classes`), then `--validation_fraction` of the
    private rows held out as the evaluation set. `hf-dp-repr audit --run` rebuilds the members with it."""
    train, public, evals = data["train"], None, data["eval"]
    if public_fraction > 0:
        public, train = ru.split_public_private(train, public_fraction, seed)
        public = shift_images(public, margs.public_shift)
        if margs.public_classes:
            keep = set(margs.public_classes)
            public = public.select([i for i, y in enumerate(public.with_format(None)["labels"]) if y in keep])
            if not len(public):
                raise RecipeArgumentError(f"--public_classes {margs.public_classes}: no public example has these "
                                          "labels (label ids, 0..num_labels-1)")
    if not 0 <= margs.validation_fraction < 1:
        raise RecipeArgumentError(f"--validation_fraction must be in [0, 1), got {margs.validation_fraction}")
    if margs.validation_fraction:
        evals, train = ru.split_public_private(train, margs.validation_fraction, seed)
    return train, public, evals


def audit_sets(run_dir: str, record: dict, model_args: dict):
    """(members, non-members) of the recipe run in `run_dir`: its private training set and evaluation set, rebuilt
    from `run_info.json` (`record`: its split record; `model_args`: the recipe's arguments)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    margs = ru.arguments(ImageArguments, model_args)
    data, image_col, label_col, _ = load_image_data(margs, record["seed"])
    ru.check_source(data["train"]._fingerprint, record, ru.data_description(margs))
    model = SimpleNamespace(config=AutoConfig.from_pretrained(run_dir))  # the preprocessing reads the config only
    data, _ = _with_pixel_values(data, margs, model, image_col, label_col, check_size=False)  # the run's own sizes
    train, _, evals = split_private(data, margs, record["public_fraction"], record["seed"])
    return train, evals


# ---- data ----------------------------------------------------------------------------------------------------
def load_image_data(margs: ImageArguments, seed: int):
    """({"train", "eval"} datasets, the image / label column names, notes for the plan and the card: a label set
    read off the rows, an evaluation split held out of the training data)."""
    name = ru.dataset_name(margs)
    if name == DIGITS:
        raw = load_embedded(DIGITS)
    elif name is not None and name.endswith(".npz"):
        raw = load_npz(name, margs.num_labels)
    else:
        raw = ru.load_raw(margs)
    columns = next(iter(raw.values())).column_names
    image_col = check_column(columns, margs.image_column, ("pixel_values", "image", "img"), "--image_column")
    label_col = check_column(columns, margs.label_column, ("labels", "label", "fine_label"), "--label_column")
    labels = encode_labels(raw, label_col, margs.class_names)
    train, evals, held_out = ru.pick_splits(labels.data, margs, seed)
    notes = [n for n in (labels.note, held_out) if n]
    if margs.train_indices_file and margs.max_train_samples_per_class:
        raise checks.RecipeArgumentError("--train_indices_file and --max_train_samples_per_class both choose the "
                                         "training subset; give one.")
    if margs.train_indices_file:
        train = train.select(read_index_file(margs.train_indices_file, len(train)))
    elif margs.max_train_samples_per_class:
        train = train.select(per_class_indices(train[label_col], margs.max_train_samples_per_class, seed))
    if margs.max_eval_samples:
        evals = evals.select(range(min(margs.max_eval_samples, len(evals))))
    return {"train": train, "eval": evals}, image_col, label_col, notes


def load_public_rows(margs: ImageArguments):
    """The `--public_dataset_name` images (its `--public_split`, the image column only, at most
    `--public_max_samples`), or None when none are given; refused before any work where they cannot serve (a
    randomly initialised model, public data given twice, a split or column that is not there)."""
    if margs.public_dataset_name is None:
        return None
    if ru.is_tiny(margs.model_name_or_path):
        raise RecipeArgumentError(f"--public_dataset_name preconditions a pretrained model's linear probe; "
                                  f"--model_name_or_path {margs.model_name_or_path} is randomly initialised: pass a "
                                  "pretrained model, or --public_fraction F to pre-train on a share of your data.")
    if margs.public_fraction:
        raise RecipeArgumentError(f"--public_dataset_name and --public_fraction {margs.public_fraction:g} both give "
                                  "public data; give one.")
    from hf_dp_repr.data.user_data import load_user_data

    raw = load_user_data(margs.public_dataset_name)
    if margs.public_split not in raw:
        raise RecipeArgumentError(f"--public_split {margs.public_split}: {margs.public_dataset_name} has the splits "
                                  f"{sorted(raw)}; pass one of them.")
    public = raw[margs.public_split]
    image_col = check_column(public.column_names, margs.image_column, ("pixel_values", "image", "img"),
                             "--image_column")
    public = public.select_columns([image_col])
    return public.select(range(min(margs.public_max_samples, len(public)))) if margs.public_max_samples else public


def public_pixel_values(public, margs: ImageArguments, processor, num_channels: int):
    """`public` (from `load_public_rows`) through the private images' preprocessing, or None."""
    if public is None:
        return None
    image_col = public.column_names[0]
    if (image_col == "pixel_values") != (processor is None):
        raise RecipeArgumentError(f"--public_dataset_name {margs.public_dataset_name}: its images and the private "
                                  "ones must come alike (both as image files, or both as pixel values).")
    if processor is None:
        return public.with_format("torch")
    return to_pixel_values(public, image_col, processor, num_channels, desc="preprocessing public images")


def _with_pixel_values(data, margs: ImageArguments, model, image_col, label_col, check_size: bool = True):
    """Rename to `pixel_values` / `labels`; images become pixel values once, with `map` (deterministic
    preprocessing, so the linear probe may cache features), after checking (`check_size`) that the model takes
    their size. Returns (data, the image processor or None)."""
    data = {k: ds.rename_column(label_col, "labels") if label_col != "labels" else ds for k, ds in data.items()}
    if image_col == "pixel_values":
        return {k: ds.with_format("torch") for k, ds in data.items()}, None
    processor, how = image_processor_for(
        margs.model_name_or_path, model.config, pretrained=not ru.is_tiny(margs.model_name_or_path),
        image_processor=margs.image_processor, image_size=margs.image_size, image_mean=margs.image_mean,
        image_std=margs.image_std)
    logger.info("image preprocessing: %s", how)
    size, want = processor.size.get("height"), getattr(model.config, "image_size", None)
    if check_size and size and isinstance(want, int) and size != want and not takes_any_image_size(model):
        raise RecipeArgumentError(f"--image_size {size}: {margs.model_name_or_path} takes {want}-px images "
                                  "(config.image_size) and does not interpolate its position embeddings; drop "
                                  f"--image_size or pass {want}.")
    out = {k: to_pixel_values(ds, image_col, processor, model.config.num_channels, desc=f"preprocessing {k} images")
           for k, ds in data.items()}
    return out, processor


def data_free_images(processor, num_channels: int, like) -> dict:
    """The inputs on which `dp_defaults.head_input_norm` measures the scale of the head's input, data-free: a black
    and a white image through the model's preprocessing (the head's inputs of images differ along this scale; the
    part every image shares, most of DINOv2's, does not move the head's step), or the normalisation mean's grey image
    alone when the data come as pixel values (`like`: a training row's, for the shape).

        >>> data_free_images(None, 1, torch.zeros(1, 8, 8))["pixel_values"].shape
        torch.Size([1, 1, 8, 8])
    """
    from PIL import Image

    if processor is None:
        return {"pixel_values": torch.zeros_like(torch.as_tensor(like))[None]}
    mode, white = ("RGB", (255, 255, 255)) if num_channels == 3 else ("L", 255)
    images = [Image.new(mode, (32, 32), 0), Image.new(mode, (32, 32), white)]
    return {"pixel_values": torch.as_tensor(processor(images, return_tensors="np")["pixel_values"]).float()}


def _collate(examples):
    batch = {"pixel_values": torch.stack([torch.as_tensor(e["pixel_values"]) for e in examples])}
    if "labels" in examples[0]:  # public images for the preconditioning come without
        batch["labels"] = torch.tensor([int(e["labels"]) for e in examples])
    return batch


def _load_model(name, num_labels, id2label, train, image_col, seed):
    if ru.is_tiny(name):
        if name != "tiny_vit":
            raise RecipeArgumentError(f"--model_name_or_path {name}: the image recipe's tiny config is tiny_vit.")
        sample = train[0][image_col]
        if image_col == "pixel_values":
            shape = tuple(torch.as_tensor(sample).shape)  # (C, H, W)
            return ru.TINY_MODELS[name](num_labels=num_labels, seed=seed, num_channels=shape[0], image_size=shape[-1])
        return ru.TINY_MODELS[name](num_labels=num_labels, seed=seed, num_channels=3, image_size=32)
    from transformers import AutoModelForImageClassification

    with explained_load_errors(name):  # a truncated weights file: name it and the fix
        return AutoModelForImageClassification.from_pretrained(
            name, num_labels=num_labels, id2label=id2label, label2id={v: k for k, v in id2label.items()},
            ignore_mismatched_sizes=True, dtype=torch.float32)  # DP-SGD in float32, whatever the stored weights


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("image_classification"))  # as recipes/*.py
