"""Utility under DP (issue 31): accuracy at ε = 1 with each accuracy technique on and off, mean ± spread over
fresh-noise runs, settings chosen on validation data, never on the test split. Not a test; prints a table.

    export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python benchmarks/utility.py demo --runs 3                  # `make demo`'s setting, its four rows
    python benchmarks/utility.py demo --runs 3 --split validation --learning_rate 0.01   # how settings are chosen
    python benchmarks/seed000_proxy_tuning.py --stage features  # once: DINOv2-S features (needs ../shared/data)
    python benchmarks/utility.py proxy --split validation        # the learning rate, on held-out rows
    python benchmarks/utility.py proxy --runs 3 --learning_rates 3  # the chosen one, on test
    python benchmarks/utility.py proxy --epsilon 8 --clip_norms 0.01 --adaptive_clipping count_share=0.1  # issue 42

Techniques (each a flag; skipped with a message while `DPTrainingArguments` has no such argument):
`--ema_decay D` (weight averaging), `--augmentation_multiplicity K` (needs a random transform on the training set;
for the demo, `-- --train_augmentation random_shift`),
`--probe_preconditioning P` (linear-probe input statistics fitted on public data only).

Demo (`demo`): the embedded default of `make demo` (recipes/configs/demo_digits.yaml: a tiny ViT pre-trained on
public digits of classes 0-4 only, DP fine-tuned on all ten classes). Each run draws a fresh secret (new batches and
noise); the public model is the same (seed 0). `--split validation` scores on 20 % of the private training rows held
out (`--validation_fraction`), the public-only row included.

Seed-000 proxy (`proxy`): a DP linear probe (full-batch DP-GD) on DINOv2-S [CLS] features of the 1000 private
CIFAR-10 images of recipes/configs/cifar10_partial_100_per_class.txt at ε = 1 (`--epsilon`), δ = 1e-4, one row per
clipping norm of `--clip_norms` (with `--adaptive_clipping`, its initial C); public data: the 1000
held-out "tune" images (labels unused); validation: the 3085 "val" images; test: the 1017 test images (the rows
and the features' cache: `benchmarks/seed000_proxy_tuning.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

TECHNIQUES = {  # DPTrainingArguments field → what it is
    "ema_decay": "weight averaging (issue 31 item 1)",
    "augmentation_multiplicity": "augmentation multiplicity (issue 31 item 2)",
    "probe_preconditioning": "public-data preconditioning of the linear probe (issue 31 item 3)",
}


def available(flags: dict) -> dict:
    """The technique flags that were given and that `DPTrainingArguments` has; a line for each one skipped."""
    from hf_dp_repr import DPTrainingArguments

    fields = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    out = {}
    for name, value in flags.items():
        if value is None:
            continue
        if name not in fields:
            print(f"SKIPPED --{name} {value}: DPTrainingArguments has no `{name}` yet ({TECHNIQUES[name]}); "
                  "re-run once it is merged.")
            continue
        out[name] = value
    return out


def spread(values: list[float]) -> str:
    """mean ± sample standard deviation, in points."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * sd:.1f} %"


# ---- the demo ---------------------------------------------------------------------------------------------------
def demo_public_only(public_dir: str, split: str, validation_fraction: float, public_fraction: float, seed: int):
    """The public model's accuracy on the demo's test split, or on the validation rows the recipe holds out."""
    from transformers import AutoModelForImageClassification

    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.scripts import utils as ru

    data = load_digits_dataset()
    if split == "validation":
        _, private = ru.split_public_private(data["train"], public_fraction, seed)
        evals, _ = ru.split_public_private(private, validation_fraction, seed)
    else:
        evals = data["test"]
    batch = evals.with_format("torch")[:]
    model = AutoModelForImageClassification.from_pretrained(public_dir).eval()
    with torch.no_grad():
        pred = model(pixel_values=batch["pixel_values"]).logits.argmax(-1)
    return float((pred == batch["labels"]).float().mean())


def run_demo(args, techniques: dict) -> dict:
    import yaml

    from hf_dp_repr.scripts import image_classification as recipe

    with open(args.config) as f:
        config = yaml.safe_load(f)
    extra = [f"--{k}={v}" for k, v in techniques.items()] + args.recipe_args
    if args.split == "validation":
        extra += ["--validation_fraction", str(args.validation_fraction)]
    from hf_dp_repr.scripts.demo import RUNS as runs  # the demo's rows, each with its own arguments
    acc = {name: [] for name in ["public_only", *runs]}
    with tempfile.TemporaryDirectory() as tmp:
        public_dir = args.public_model_dir or f"{tmp}/public"
        for r in range(args.runs):
            for name, differs in runs.items():
                if name not in args.rows:
                    continue
                t0 = time.time()
                metrics = recipe.main(["--config", args.config, "--output_dir", f"{tmp}/{name}-{r}",
                                       "--public_model_dir", public_dir, "--analyze_representations", "false",
                                       "--overwrite_output_dir", "true", *differs, *extra])
                acc[name].append(metrics["eval_accuracy"])
                print(f"run {r + 1}/{args.runs} {name}: {100 * metrics['eval_accuracy']:.1f} % "
                      f"({time.time() - t0:.0f} s)", flush=True)
        acc["public_only"] = [demo_public_only(public_dir, args.split, args.validation_fraction,
                                               float(config.get("public_fraction", 0.5)), int(config.get("seed", 0)))]
    return {k: v for k, v in acc.items() if v}


# ---- the seed-000 proxy -----------------------------------------------------------------------------------------
def run_proxy(args, techniques: dict) -> dict:
    """DP linear probes on the cached DINOv2-S [CLS] features, at ε = 1, for each feature map of `--norms` (raw;
    pcaK: standardised and projected on the top K principal axes of the public features, by hand, as item 3's
    argument should do inside the library). With `--split validation` every learning rate of `--learning_rates` is
    scored on the held-out "val" rows; on test only the first one runs."""
    import inspect
    import warnings

    import seed000_proxy_tuning as s0  # benchmarks/, the script's folder, is on sys.path

    from hf_dp_repr import DPTrainer

    if not os.path.exists(s0.CACHE):
        raise SystemExit(f"no features at {s0.CACHE}: run `python benchmarks/seed000_proxy_tuning.py --stage features` "
                         "first (needs ../shared/data; about 40 min on 2 busy cores)")
    data = s0.load_features()
    stats = s0.held_out_stats(data["tune"][0])  # the public 1000: their labels are never used
    evals = s0.FeatureSet(*data["val" if args.split == "validation" else "test"])
    extra = {}
    if "probe_preconditioning" in techniques and "public_train_dataset" in inspect.signature(DPTrainer).parameters:
        extra["public_train_dataset"] = s0.FeatureSet(*data["tune"])
        techniques = {**techniques, "trainable_blocks": 0}  # the scope preconditioning is for: the head alone
    lrs = args.learning_rates if args.split == "validation" else args.learning_rates[:1]
    acc = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for norm in args.norms:
            for lr in lrs:
              for clip in args.clip_norms:
                name = f"ε={args.epsilon:g} {norm}, lr {lr:g}, C {clip:g}" + (f", adaptive {args.adaptive_clipping}"
                                                                            if args.adaptive_clipping else "")
                acc[name], final_clip = [], []
                for _ in range(args.runs):  # no noise_seed: each run draws a fresh secret
                    targs = s0.dp_args(tmp, args.epsilon, 1e-4, per_device_train_batch_size=1000,
                                       max_steps=args.steps, learning_rate=lr, per_sample_max_grad_norm=clip,
                                       head_init="zeros", adaptive_clipping=args.adaptive_clipping, **techniques)
                    trainer = DPTrainer(model=s0.FeatureProbe("cls", norm, stats), args=targs,
                                        train_dataset=s0.FeatureSet(*data["private"]), eval_dataset=evals,
                                        compute_metrics=s0.accuracy, **extra)
                    trainer.train()
                    acc[name].append(trainer.evaluate()["eval_accuracy"])
                    final_clip.append(final_clip_norm(trainer))
                print(f"{name}: {spread(acc[name])}" + (f"; final C {', '.join(f'{c:.3g}' for c in final_clip)}"
                                                       if args.adaptive_clipping else ""), flush=True)
    return acc


def search_cost(epsilon: float, steps: int, runs: list[int]) -> None:
    """ε (dp_accounting PLD, add/remove, δ = 1e-4) of k proxy runs on the same private 1000, each at σ calibrated for
    `epsilon` (full batch: `steps` Gaussian mechanisms a run): what a search over k settings spends."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from hf_dp_repr import DPTrainingArguments
    from hf_dp_repr.training.plan import plan_run

    args = DPTrainingArguments(output_dir=tempfile.gettempdir(), target_epsilon=epsilon, target_delta=1e-4,
                               accountant="prv", per_device_train_batch_size=1000, max_steps=steps, report_to="none")
    sigma = plan_run(args, dataset_size=1000).phases[0].noise_multiplier
    for k in runs:
        accountant = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), steps * k))
        print(f"target ε {epsilon:g} (σ = {sigma:.4g}): {k} run(s) of {steps} full-batch steps compose to "
              f"ε = {accountant.get_epsilon(1e-4):.3f} at δ = 1e-4")


def final_clip_norm(trainer) -> float:
    """C after the last step: adaptive clipping's last entry of the ledger's `clip_norms`, else the fixed C."""
    return float(trainer.ledger.clip_norm)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["demo", "proxy"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--split", choices=["test", "validation"], default="test")
    parser.add_argument("--validation_fraction", type=float, default=0.2)
    parser.add_argument("--config", default="recipes/configs/demo_digits.yaml")
    parser.add_argument("--public_model_dir", help="demo: keep the public model here and reuse it across invocations "
                        "(the recipe retrains it when its settings differ); default: a temporary folder")
    parser.add_argument("--rows", nargs="+", default=["dp_eps1", "dp_eps8", "non_private"],
                        help="demo rows (hf_dp_repr.scripts.demo.RUNS)")
    parser.add_argument("--norms", nargs="+", default=["raw", "pca32"], help="proxy: feature maps (raw, pcaK, ...)")
    parser.add_argument("--learning_rates", nargs="+", type=float, default=[1.0, 3.0, 10.0], help="proxy")
    parser.add_argument("--steps", type=int, default=200, help="proxy: full-batch DP-GD steps")
    parser.add_argument("--epsilon", type=float, default=1.0, help="proxy: the target ε (δ = 1e-4)")
    parser.add_argument("--clip_norms", nargs="+", type=float, default=[1.0],
                        help="proxy: clipping norms C, each a row (adaptive clipping: its initial C)")
    parser.add_argument("--adaptive_clipping", help="proxy: DPTrainingArguments.adaptive_clipping, e.g. "
                        "count_share=0.1 (docs/adaptive-clipping.md)")
    parser.add_argument("--search_cost", nargs="+", type=int, help="proxy: only print the ε that this many runs at "
                        "--epsilon compose to (a search over that many settings), e.g. 1 5 6")
    parser.add_argument("--ema_decay", type=float)
    parser.add_argument("--augmentation_multiplicity", type=int)
    parser.add_argument("--probe_preconditioning")
    # more recipe arguments after --, e.g. -- --learning_rate 0.01 (split off by hand: argparse's positional nargs="*"
    # is matched, empty, right after `what`, so it never takes them)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.recipe_args = argv[cut + 1:]
    torch.set_num_threads(1)
    techniques = available({name: getattr(args, name) for name in TECHNIQUES})
    if args.search_cost:
        search_cost(args.epsilon, args.steps, args.search_cost)
        return
    start = time.time()
    if args.what == "demo":
        acc = run_demo(args, techniques)
    else:
        acc = run_proxy(args, techniques)
    on = ", ".join(f"{k}={v}" for k, v in techniques.items()) or "none"
    print(f"\n{args.what}, {args.split} split, techniques: {on}, {args.runs} runs, "
          f"{time.time() - start:.0f} s, load {os.getloadavg()[0]:.1f}")
    print("| row | accuracy (mean ± sd) | runs |\n|---|---|---|")
    for name, values in acc.items():
        print(f"| {name} | {spread(values)} | {len(values)} |")
    print(json.dumps({k: [round(v, 4) for v in vals] for k, vals in acc.items()}))


if __name__ == "__main__":
    main()
