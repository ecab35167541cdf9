"""`hf-dp-repr analyze`: the representation laws of one or more models on one dataset → JSON + PNG.

    hf-dp-repr analyze --model ./vit-pretrained --model ./vit-dp-eps1 --model ./vit-dp-eps8 \\
        --dataset digits --split test --out law/

Datasets: `digits` (sklearn's digits, offline), `stdlib-docs` (docstrings of the Python standard library,
offline; see `corpus.py`), a directory written by `Dataset(Dict).save_to_disk`, or a Hub dataset name.
Vision data need `pixel_values` (or an `image`/`img` column, turned into pixel values by the model's image
processor) and `labels`/`label`; text data need `input_ids` or a `text` column (tokenised per model).

Models load with the architecture class recorded in their config (`config.architectures`, e.g.
ViTForImageClassification) or else `AutoModel`, in float32.

Example (in Python; on the command line the same arguments follow `hf-dp-repr analyze`):
    >>> import argparse, tempfile
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> from hf_dp_repr.analysis.cli import add_analyze_parser, run_analyze
    >>> path = tempfile.mkdtemp(); tiny_vit().save_pretrained(path)
    >>> parser = argparse.ArgumentParser(); _ = add_analyze_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["analyze", "--model", path, "--dataset", "digits", "--out", path + "/law"])
    >>> args.func(args)  # doctest: +ELLIPSIS
    wrote .../law/representation_law.json and .../law/representation_law.png
    0
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from .batches import LANGUAGE, VISION
from .features import POOLINGS, analyze_representations, extract_features
from .knn import knn_probe
from .plots import plot_laws

__all__ = ["add_analyze_parser", "run_analyze", "EMBEDDED_DATASETS"]

logger = logging.getLogger(__name__)
EMBEDDED_DATASETS = ("digits", "stdlib-docs")


def add_analyze_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `analyze` subcommand on an argparse `subparsers` object (sets `func=run_analyze`)."""
    p = subparsers.add_parser("analyze", help="separation fuzziness / prediction residual laws of models",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME_OR_PATH",
                   help="model to analyse (Hub name or local path); repeat for several models on one plot")
    p.add_argument("--label", action="append", metavar="TEXT",
                   help="legend label per --model, in the same order (default: the model's name)")
    p.add_argument("--dataset", required=True, metavar="NAME_OR_PATH",
                   help=f"{' | '.join(EMBEDDED_DATASETS)} (offline), a save_to_disk directory, or a Hub name")
    p.add_argument("--split", default="test", help="split to analyse (default: test)")
    p.add_argument("--max-examples", type=int, default=None, metavar="N", help="analyse at most N rows")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--pooling", choices=POOLINGS, default="cls", help="vision: [CLS] token or patch mean")
    p.add_argument("--block-size", type=int, default=128, help="text: tokens per sequence (capped by the model)")
    p.add_argument("--knn", action="store_true",
                   help="vision: also report the DINO kNN accuracy of the last hidden state (memory: train split)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for the JSON and PNG")
    p.set_defaults(func=run_analyze)
    return p


def run_analyze(args: argparse.Namespace) -> int:
    """Analyse every `--model` on `--dataset`; write DIR/representation_law.json and .png. Returns 0."""
    if args.label and len(args.label) != len(args.model):
        raise SystemExit(f"error: {len(args.label)} --label for {len(args.model)} --model; give one per model")
    labels = args.label or _default_labels(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, reports = {}, {}
    for label, name in zip(labels, args.model):
        logger.info("analysing %s on %s/%s", name, args.dataset, args.split)
        model, tokenizer = _load_model(name, args.device)
        data = _load_split(args, args.split, name, model, tokenizer)
        report = analyze_representations(model, data, batch_size=args.batch_size, pooling=args.pooling,
                                         max_examples=args.max_examples)
        entry = {"model": name, **report.to_dict()}
        if args.knn:
            entry["knn_accuracy"] = _knn(args, name, model, tokenizer, data, report.task)
        results[label], reports[label] = entry, report
    meta = {"dataset": args.dataset, "split": args.split, "max_examples": args.max_examples}
    (out / "representation_law.json").write_text(json.dumps({**meta, "models": results}, indent=2))
    plot_laws(reports, out / "representation_law.png", title=f"{args.dataset} ({args.split})")
    print(f"wrote {out / 'representation_law.json'} and {out / 'representation_law.png'}")
    return 0


def _default_labels(names: list[str]) -> list[str]:
    labels = [Path(n).name or n for n in names]
    return labels if len(set(labels)) == len(labels) else list(names)


def _load_model(name: str, device: str) -> tuple[torch.nn.Module, Any]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(name)
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, arch, None) if arch else None
    model = (model_class or transformers.AutoModel).from_pretrained(name, dtype=torch.float32)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError):  # no tokenizer files saved with the model
        tokenizer = None
    # transformers 5 builds an empty tokenizer (vocab 0) for a checkpoint saved without tokenizer files.
    if tokenizer is not None and not tokenizer("hello world", add_special_tokens=False)["input_ids"]:
        tokenizer = None
    return model.to(device).eval(), tokenizer


def _load_split(args, split: str, name: str, model, tokenizer) -> Any:
    if args.dataset == "digits":
        from hf_dp_repr.data import load_digits_dataset

        return _pick(load_digits_dataset(), split)
    if args.dataset == "stdlib-docs":
        from .corpus import load_text_dataset

        if tokenizer is None:
            logger.warning("%s has no tokenizer: using the byte-level fallback (see corpus.py)", name)
        block = min(args.block_size, getattr(model.config, "max_position_embeddings", None) or args.block_size)
        return _pick(load_text_dataset(tokenizer, vocab_size=model.config.vocab_size, block_size=block), split)
    import datasets

    if Path(args.dataset).exists():
        data = datasets.load_from_disk(args.dataset)
        data = _pick(data, split) if isinstance(data, datasets.DatasetDict) else data
    else:
        data = datasets.load_dataset(args.dataset, split=split)
    return _prepare(data, name, tokenizer, args.block_size)


def _pick(data, split: str):
    if split not in data:
        raise SystemExit(f"error: split {split!r} not in the dataset; choose --split from {sorted(data)}")
    return data[split]


def _prepare(data, name: str, tokenizer, block_size: int):
    """Map raw `image` / `text` columns to model inputs; rename `label` to `labels`."""
    if "label" in data.column_names and "labels" not in data.column_names:
        data = data.rename_column("label", "labels")
    image_col = next((c for c in ("image", "img") if c in data.column_names), None)
    if "pixel_values" not in data.column_names and image_col is not None:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(name)

        def transform(batch):
            images = [im.convert("RGB") for im in batch[image_col]]
            return {"pixel_values": processor(images, return_tensors="pt")["pixel_values"],
                    "labels": batch["labels"]}

        data.set_transform(transform)
    elif "input_ids" not in data.column_names and "text" in data.column_names:
        if tokenizer is None:
            raise SystemExit(f"error: {name} has no tokenizer to tokenise the `text` column")
        data = data.map(lambda b: tokenizer(b["text"], truncation=True, max_length=block_size), batched=True,
                        remove_columns=data.column_names).filter(lambda r: len(r["input_ids"]) > 1)
    return data


def _knn(args, name: str, model, tokenizer, data, task: str) -> float:
    if task != VISION:
        raise SystemExit(f"error: --knn needs a vision dataset; {args.dataset} is {LANGUAGE}")
    if args.split == "train":
        raise SystemExit("error: --knn uses the train split as memory; analyse another --split")
    memory = _load_split(args, "train", name, model, tokenizer)
    kwargs = dict(pooling=args.pooling, batch_size=args.batch_size)
    x_mem, y_mem = extract_features(model, memory, **kwargs)
    x_query, y_query = extract_features(model, data, max_examples=args.max_examples, **kwargs)
    return knn_probe(x_mem, y_mem, x_query, y_query)
