"""The DP-aware defaults (hf_dp_repr.scripts.dp_defaults) on a user's own data, made here (issue 40.2). Not a test;
prints a table (mean ± sd over fresh-noise runs) and writes `<work>/<task>.json`.

    export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1
    python benchmarks/dp_defaults.py images --seeds 0 1 2     # CIFAR-10 PNGs as an imagefolder + DINOv2-S (../shared)
    python benchmarks/dp_defaults.py text --seeds 0 1 2       # stdlib docstrings, string labels, the default MiniLM
    python benchmarks/dp_defaults.py text --seeds 0 1 2 --extra --per_device_train_batch_size 8   # one flag given
    python benchmarks/dp_defaults.py images --per_class 100 --test_per_class 1000 --public_per_class 100  # + public

`images`: `--per_class` training and `--test_per_class` test images of each CIFAR-10 class from
`../shared/data/cifar10_partial.npz`, written as PNG files in `train/<class>/` and `test/<class>/` (an imagefolder:
the class names are the folder names), with the real pretrained DINOv2-S of `../shared/data` (no image processor:
the family's defaults); `--public_per_class K` writes K other training images of each class, without labels, to
`public_K/` and gives it to the DP runs as `--public_dataset_name` (public images the user has; the non-private
reference does not use them). `text`: six modules' docstring paragraphs of Python's standard library (`stdlib-topics`)
with their module name as a string label, written as CSV (`text,category`) and loaded as the user's own data. Each
row of the table is a recipe run with nothing but the model, the data, ε and the output folder given (plus `--extra`);
the reference is the same probe non-private (`--trainable_blocks 0 --noise_multiplier 0 --clipping none`), plain
SGD at the DP runs' learning rate and at 4× it, the better of the two. `--variants` adds rows with options given.
Runs share one process, so the frozen backbone's features are computed once. `snr` is the expected signal-to-noise
of an update the run's plan gives (`hf_dp_repr.training.privacy_report.update_snr`: C over the noise norm of the
averaged update).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_DP_REPR_SHARED_DATA", ROOT.parent / "shared" / "data"))
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
TEXT_MODULES = ("collections", "pathlib", "subprocess", "typing", "logging", "os")


def make_imagefolder(work: Path, per_class: int, test_per_class: int) -> str:
    import numpy as np
    from PIL import Image

    folder = work / f"cifar_{per_class}_{test_per_class}"
    if folder.exists():
        return str(folder)
    arrays, part = np.load(SHARED / "cifar10_partial.npz"), folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)  # a run stopped while writing: written whole, then renamed
    for split, x, y, k in (("train", arrays["x_train"], arrays["y_train"], per_class),
                           ("test", arrays["x_test"], arrays["y_test"], test_per_class)):
        for c, name in enumerate(CIFAR_CLASSES):
            (part / split / name).mkdir(parents=True, exist_ok=True)
            for i in np.flatnonzero(y == c)[:k]:
                Image.fromarray(x[i]).save(part / split / name / f"{i}.png")
    part.rename(folder)
    return str(folder)


def make_public_folder(work: Path, skip_per_class: int, per_class: int) -> str:
    """`per_class` training images of each class after the first `skip_per_class` (disjoint from the private ones),
    as unlabelled PNG files in one folder."""
    import numpy as np
    from PIL import Image

    folder = work / f"public_{skip_per_class}_{per_class}"
    if folder.exists():
        return str(folder)
    arrays, part = np.load(SHARED / "cifar10_partial.npz"), folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    for c in range(len(CIFAR_CLASSES)):
        for i in np.flatnonzero(arrays["y_train"] == c)[skip_per_class:skip_per_class + per_class]:
            Image.fromarray(arrays["x_train"][i]).save(part / f"{i}.png")
    part.rename(folder)
    return str(folder)


def make_text_csv(work: Path) -> dict:
    """{"train": csv path, "test": csv path}: `text,category` rows, the category a string."""
    from hf_dp_repr.data import STDLIB_TOPICS, load_embedded

    data = load_embedded(STDLIB_TOPICS)
    names = data["train"].features["labels"].names
    paths = {}
    for split in ("train", "test"):
        paths[split] = work / f"stdlib_{split}.csv"
        with open(paths[split], "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "category"])
            for row in data[split]:
                if names[row["labels"]] in TEXT_MODULES:
                    writer.writerow([row["text"], names[row["labels"]]])
    return {k: str(v) for k, v in paths.items()}


def csv_as_dataset(paths: dict, work: Path) -> str:
    """The CSV files as a DatasetDict with the string categories cast to a ClassLabel (the names sorted), saved to
    disk: what `--train_file`/`--label_column` do where the recipes read CSV themselves."""
    import datasets

    raw = datasets.load_dataset("csv", data_files=paths)
    names = sorted(set(raw["train"]["category"]))
    raw = raw.map(lambda b: {"labels": [names.index(c) for c in b["category"]]}, batched=True,
                  remove_columns=["category"])
    raw = raw.cast_column("labels", datasets.ClassLabel(names=names))
    out = work / "stdlib_csv_dataset"
    raw.save_to_disk(str(out))
    return str(out)


class PlanLines(logging.Handler):
    """Keeps the noise norm that the plan logs (σ·C·√P/B) and C."""

    def __init__(self):
        super().__init__()
        self.noise_norm = self.clip = self.learning_rate = None

    def emit(self, record):
        text = record.getMessage()
        if m := re.search(r"σ·C·√P/B = ([0-9.e+-]+)", text):
            self.noise_norm = float(m.group(1))
        if m := re.search(r"C=([0-9.e+-]+),", text):
            self.clip = float(m.group(1))
        if m := re.search(r"--learning_rate ([0-9.e+-]+):", text):
            self.learning_rate = float(m.group(1))


def run(task: str, data: str, model: str | None, out: Path, seed: int, epsilon: float | None, extra: list[str]):
    if task == "images":
        from hf_dp_repr.scripts import image_classification as recipe
    else:
        from hf_dp_repr.scripts import text_classification as recipe
    argv = ["--dataset_name", data, "--output_dir", str(out), "--seed", str(seed), "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true", "--overwrite_output_dir", "true"]
    argv += (["--model_name_or_path", model] if model else [])
    argv += (["--target_epsilon", str(epsilon)] if epsilon else ["--noise_multiplier", "0", "--clipping", "none"])
    lines = PlanLines()
    logging.getLogger("hf_dp_repr").addHandler(lines)
    start = time.time()
    try:
        metrics = recipe.main(argv + extra)
    finally:
        logging.getLogger("hf_dp_repr").removeHandler(lines)
    snr = (lines.clip / lines.noise_norm) if lines.noise_norm else float("inf")
    return {"seed": seed, "epsilon": metrics.get("epsilon"), "accuracy": metrics["eval_accuracy"],
            "snr": snr, "learning_rate": lines.learning_rate, "seconds": round(time.time() - start, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("images", "text"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--per_class", type=int, default=30)
    parser.add_argument("--test_per_class", type=int, default=20)
    parser.add_argument("--public_per_class", type=int, default=0, help="images: give the DP runs this many other "
                        "unlabelled training images of each class as --public_dataset_name")
    parser.add_argument("--work", default="out/dp_defaults")
    parser.add_argument("--no_reference", action="store_true", help="skip the non-private reference run")
    parser.add_argument("--variants", nargs="+", default=[], help="more rows in the same process (the features "
                        "computed once), each a quoted string of recipe options, e.g. '--learning_rate 0.1'")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="recipe options given on top")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.task == "images":
        data, model = make_imagefolder(work, args.per_class, args.test_per_class), str(SHARED / "dinov2-small-imgfocus")
    else:
        data, model = csv_as_dataset(make_text_csv(work), work), None  # the recipe's default model
    public = (["--public_dataset_name", make_public_folder(work, args.per_class, args.public_per_class)]
              if args.public_per_class else [])
    rows = [run(args.task, data, model, work / "run", s, args.epsilon, public + args.extra) for s in args.seeds]
    variants = {flags: [run(args.task, data, model, work / "run", s, args.epsilon, public + flags.split() + args.extra)
                        for s in args.seeds] for flags in args.variants}
    refs = []  # a plain SGD probe at the DP runs' learning rate and 4× it; the better one counts
    for lr in ([] if args.no_reference else [rows[0]["learning_rate"], 4 * rows[0]["learning_rate"]]):
        extra = ["--trainable_blocks", "0", "--optim", "sgd", "--learning_rate", str(lr), *args.extra]
        refs.append({**run(args.task, data, model, work / "run", 0, None, extra), "learning_rate": lr})
    ref = max(refs, key=lambda r: r["accuracy"]) if refs else None
    accs = [100 * r["accuracy"] for r in rows]
    for flags, vrows in variants.items():
        vaccs = [100 * r["accuracy"] for r in vrows]
        sd = statistics.stdev(vaccs) if len(vaccs) > 1 else 0.0
        print(f"variant {flags}: {statistics.mean(vaccs):.1f} ± {sd:.1f} % ({', '.join(f'{a:.1f}' for a in vaccs)})",
              flush=True)
    summary = {"task": args.task, "epsilon": args.epsilon, "extra": public + args.extra, "runs": rows,
               "references": refs,
               "variants": variants,
               "mean": statistics.mean(accs), "sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
               "load": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (work / f"{args.task}.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.task}, ε = {args.epsilon:g}, given {' '.join(summary['extra']) or 'nothing else'}: "
          f"{summary['mean']:.1f} ± {summary['sd']:.1f} % over {len(rows)} runs "
          f"({', '.join(f'{a:.1f}' for a in accs)}); update SNR {rows[0]['snr']:.3g}; "
          + (f"non-private reference {100 * ref['accuracy']:.1f} % (SGD lr {ref['learning_rate']:g})" if ref else
             "no reference")
          + f"; load {summary['load'][0]:.1f}", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
