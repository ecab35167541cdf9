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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see hf_dp_repr/scripts/utils.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_dp_repr import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp_repr.scripts import checks  # noqa: E402
from hf_dp_repr.scripts import report as recipe_report  # noqa: E402
from hf_dp_repr.scripts import utils as ru  # noqa: E402

logger = logging.getLogger("hf_dp_repr.recipes.image")
DIGITS = "digits"


@dataclass
class ImageArguments:
    """Model and data of the image recipe."""

    model_name_or_path: str = field(default="tiny_vit", metadata={
        "help": "Hub name (google/vit-base-patch16-224-in21k), local folder, or built-in tiny config (tiny_vit)."})
    dataset_name: str = field(default=DIGITS, metadata={
        "help": "'digits' (embedded, offline), a save_to_disk folder, or a datasets.load_dataset name/folder."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_split: str = field(default="train", metadata={"help": "Split trained on (the private data)."})
    eval_split: str = field(default="test", metadata={"help": "Split evaluated on (held out)."})
    image_column: str | None = field(default=None, metadata={
        "help": "Image column (default: the first of pixel_values, image, img)."})
    label_column: str | None = field(default=None, metadata={
        "help": "Label column (default: the first of labels, label, fine_label)."})
    num_labels: int | None = field(default=None, metadata={
        "help": "Number of classes (labels 0..N-1), when the dataset does not declare them (a label column that is "
                "not a ClassLabel, a .npz without class_names). Never read off the private labels."})
    max_train_samples_per_class: int | None = field(default=None, metadata={
        "help": "Keep this many training images per class (seed 000: 100), chosen with --seed."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many images."})
    image_size: int | None = field(default=None, metadata={
        "help": "Resize images to this size when the model has no image processor of its own (default: the "
                "model config's image_size)."})
    public_fraction: float | None = field(default=None, metadata={
        "help": "Share of the training split used as PUBLIC data: the model is first trained on it non-privately, "
                "then DP fine-tuned on the disjoint rest. Default: 0.5 for a tiny config (no pretrained weights), "
                "0 (no public data) otherwise."})
    public_epochs: float = field(default=40, metadata={"help": "Epochs of the non-private public pre-training."})
    public_learning_rate: float = field(default=3e-3, metadata={"help": "Learning rate of the public pre-training."})
    public_batch_size: int = field(default=32, metadata={"help": "Batch size of the public pre-training."})
    public_model_dir: str | None = field(default=None, metadata={
        "help": "Where the publicly pre-trained model is saved (default: <output_dir>/public_pretrained); reused "
                "when it holds a model pre-trained with the same settings."})
    analyze_representations: bool = field(default=False, metadata={
        "help": "Measure the representation laws (separation fuzziness, prediction residual) on the eval split "
                "at the start and end of training: representation_law.json + plot, ρ in the model card."})
    analysis_max_examples: int | None = field(default=None, metadata={"help": "Analyse at most this many images."})
    config: str | None = field(default=None, metadata={
        "help": "YAML file of arguments (recipes/configs/*.yaml); command-line arguments override it."})


ARGUMENT_TYPES = (ImageArguments, DPTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (accuracy, ε, ...)."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    targs.remove_unused_columns = False  # the collator below picks the columns

    data, image_col, label_col = load_image_data(margs, targs.seed)
    model_name = margs.model_name_or_path
    num_labels, id2label = checks.class_names(
        data["train"], label_col, margs.num_labels, others=[data["eval"]],
        model_id2label=None if ru.is_tiny(model_name) else checks.model_config_labels(model_name))
    model = _load_model(model_name, num_labels, id2label, data["train"], image_col, targs.seed)
    data = _with_pixel_values(data, model_name, model, image_col, label_col, margs.image_size)
    collate = _collate

    public_fraction = margs.public_fraction if margs.public_fraction is not None else (
        0.5 if ru.is_tiny(model_name) else 0.0)
    train, public = data["train"], None
    if public_fraction > 0:
        public, train = ru.split_public_private(train, public_fraction, targs.seed)
    plan = checks.check_before_work(model, train, targs)  # before any work and before anything is written
    recipe_report.default_logging(targs, plan.planned_steps, margs.given_options)
    if public is not None:
        save_dir = margs.public_model_dir or os.path.join(targs.output_dir, "public_pretrained")
        signature = dict(model=model_name, dataset=margs.dataset_name, split=margs.train_split,
                         fraction=public_fraction, seed=targs.seed, epochs=margs.public_epochs,
                         lr=margs.public_learning_rate, batch=margs.public_batch_size,
                         per_class=margs.max_train_samples_per_class)
        path = ru.pretrain_on_public(model, public, save_dir=save_dir, training_args=targs,
                                     epochs=margs.public_epochs, learning_rate=margs.public_learning_rate,
                                     batch_size=margs.public_batch_size, signature=signature,
                                     data_collator=collate, log=logger.info)
        model = type(model).from_pretrained(path)  # the path a Hub name takes

    callbacks = []
    if margs.analyze_representations:
        from hf_dp_repr.analysis import RepresentationLawCallback

        callbacks.append(RepresentationLawCallback(data["eval"], max_examples=margs.analysis_max_examples))

    trainer = DPTrainer(model=model, args=targs, train_dataset=train, eval_dataset=data["eval"],
                        data_collator=collate, compute_metrics=ru.accuracy_metrics(), callbacks=callbacks)
    trainer.model_card_info = dict(
        model_name=f"{model_name} fine-tuned on {margs.dataset_name}",
        base_model=None if ru.is_tiny(model_name) else model_name,
        base_model_description=(f"{model_name} (built-in tiny config, random init), pre-trained here on the public "
                                "data" if ru.is_tiny(model_name) and public else model_name),
        datasets=[margs.dataset_name] if margs.dataset_name != DIGITS else [],
        private_data=f"{len(train)} examples of the '{margs.train_split}' split of {margs.dataset_name}"
                     + (f" (the {1 - public_fraction:.0%} not used as public data)" if public else ""),
        public_data=(f"{len(public)} other examples of the same split, disjoint from the private ones, used for "
                     f"non-private pre-training of the randomly initialised {model_name}" if public else
                     f"the pre-trained weights of {model_name} (not trained on the private data here)"),
        analysis_data=f"the '{margs.eval_split}' split ({len(data['eval'])} examples, not trained on)",
    )
    result = trainer.train()
    return ru.finish_run(trainer, result, margs, push=push)


# ---- data ----------------------------------------------------------------------------------------------------
def load_image_data(margs: ImageArguments, seed: int):
    """{"train", "eval"} datasets and the image / label column names."""

    if margs.dataset_name == DIGITS:
        from hf_dp_repr.data import load_digits_dataset

        raw = load_digits_dataset()
    elif margs.dataset_name.endswith(".npz"):
        raw = _load_npz(margs.dataset_name, margs.num_labels)
    else:
        raw = ru.load_hub_or_disk(margs.dataset_name, margs.dataset_config_name)
    train, evals = ru.pick_splits(raw, margs.dataset_name, margs.train_split, margs.eval_split)
    image_col = margs.image_column or ru.first_column(train.column_names, ("pixel_values", "image", "img"),
                                                      "--image_column")
    label_col = margs.label_column or ru.first_column(train.column_names, ("labels", "label", "fine_label"),
                                                      "--label_column")
    if margs.max_train_samples_per_class:
        train = _per_class(train, label_col, margs.max_train_samples_per_class, seed)
    if margs.max_eval_samples:
        evals = evals.select(range(min(margs.max_eval_samples, len(evals))))
    return {"train": train, "eval": evals}, image_col, label_col


def _load_npz(path: str, num_labels: int | None = None):
    """A .npz of uint8 images (N, H, W, C) and int labels: x_train, y_train, x_test, y_test (e.g. CIFAR arrays), and
    optionally class_names. The classes are declared (class_names, or `--num_labels`), never read off the labels."""
    import datasets

    arrays = np.load(path)
    missing = {"x_train", "y_train", "x_test", "y_test"} - set(arrays.files)
    if missing:
        raise ValueError(f"--dataset_name {path}: a .npz needs x_train, y_train, x_test, y_test; missing {missing}")
    names = [str(n) for n in arrays["class_names"]] if "class_names" in arrays.files else None
    if names is None and num_labels is None:
        raise checks.RecipeArgumentError(f"--dataset_name {path}: the .npz declares no class_names; pass --num_labels "
                                         "N (labels 0..N-1), e.g. --num_labels 10 for CIFAR-10.")
    if names is not None and num_labels is not None and num_labels != len(names):
        raise checks.RecipeArgumentError(f"--num_labels {num_labels}, but {path} declares {len(names)} class_names; "
                                         "drop --num_labels.")
    n_classes = len(names) if names is not None else num_labels
    for key in ("y_train", "y_test"):
        y = arrays[key]
        if y.size and (y.min() < 0 or y.max() >= n_classes):
            raise checks.RecipeArgumentError(f"--dataset_name {path}: {key} holds labels outside 0..{n_classes - 1} "
                                             "(the declared classes); fix the arrays or --num_labels.")
    label = datasets.ClassLabel(names=names) if names is not None else datasets.ClassLabel(num_classes=n_classes)
    features = datasets.Features({"img": datasets.Image(), "label": label})

    def split(x, y):
        return datasets.Dataset.from_dict({"img": list(x), "label": [int(v) for v in y]}, features=features)

    return datasets.DatasetDict(train=split(arrays["x_train"], arrays["y_train"]),
                                test=split(arrays["x_test"], arrays["y_test"]))


def _per_class(ds, label_col, k, seed):
    labels = np.asarray(ds[label_col])
    rng = np.random.default_rng(seed)
    keep = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:k] for c in np.unique(labels)])
    return ds.select(np.sort(keep))


def _with_pixel_values(data, model_name, model, image_col, label_col, image_size=None):
    """Rename to `pixel_values` / `labels`; decode images lazily with the model's image processor."""
    out = {}
    for key, ds in data.items():
        if label_col != "labels":
            ds = ds.rename_column(label_col, "labels")
        if image_col == "pixel_values":
            out[key] = ds.with_format("torch")
            continue
        processor = _image_processor(model_name, model, image_size)

        def transform(batch, _col=image_col, _proc=processor):
            images = [im.convert("RGB") if model.config.num_channels == 3 else im.convert("L") for im in batch[_col]]
            return {"pixel_values": _proc(images, return_tensors="pt")["pixel_values"], "labels": batch["labels"]}

        out[key] = ds.with_transform(transform)
    return out


def _image_processor(model_name, model, image_size=None):
    from transformers import AutoImageProcessor, ViTImageProcessor

    if not ru.is_tiny(model_name):
        try:
            return AutoImageProcessor.from_pretrained(model_name)
        except OSError:
            logger.warning("no image processor found for %s; resizing to the model's image size", model_name)
    size = image_size or model.config.image_size
    return ViTImageProcessor(size={"height": size, "width": size}, do_normalize=True)


def _collate(examples):
    return {"pixel_values": torch.stack([torch.as_tensor(e["pixel_values"]) for e in examples]),
            "labels": torch.tensor([int(e["labels"]) for e in examples])}


def _load_model(name, num_labels, id2label, train, image_col, seed):
    if ru.is_tiny(name):
        if name != "tiny_vit":
            raise ValueError(f"--model_name_or_path {name}: the image recipe's tiny config is tiny_vit.")
        sample = train[0][image_col]
        if image_col == "pixel_values":
            shape = tuple(torch.as_tensor(sample).shape)  # (C, H, W)
            return ru.TINY_MODELS[name](num_labels=num_labels, seed=seed, num_channels=shape[0], image_size=shape[-1])
        return ru.TINY_MODELS[name](num_labels=num_labels, seed=seed, num_channels=3, image_size=32)
    from transformers import AutoModelForImageClassification

    return AutoModelForImageClassification.from_pretrained(
        name, num_labels=num_labels, id2label=id2label, label2id={v: k for k, v in id2label.items()},
        ignore_mismatched_sizes=True, dtype=torch.float32)  # DP-SGD in float32, whatever the stored weights


if __name__ == "__main__":
    main()
