"""`hf-dp-repr audit canaries`: the one-run canary audit (Steinke, Nasr & Jagielski 2023) from the command line.

    hf-dp-repr audit canaries --model out/public_pretrained --train data/private --canaries 1000 --k 250 \\
        --out audit/ -- --target_epsilon 1 --target_delta 1e-5 --num_train_epochs 3 --per_device_train_batch_size 64
    hf-dp-repr audit canaries --kind ood --canary-source digits:test --model ... --train ... --out audit/ -- ...

It trains the model in `--model` (a `save_pretrained` folder: the starting weights, e.g. the public pre-trained
model) once with DPTrainer on `--train` plus the included canaries, under the `DPTrainingArguments` given after
`--` (the recipes' flags), guesses which canaries were trained on and writes DIR/privacy_audit_canaries.json: m,
k, guesses, correct, the ε lower bound at `--confidence`, the most it could certify (`epsilon_ceiling`), the claimed
ε. Before training it prints that ceiling (`audit_ceiling`: how often a canary is sampled bounds what even a run with
noise off can reveal) and warns when it is below the claimed ε: the audit cannot tell a broken run from a correct one.
The audit's run is not kept (its model carries the canaries): it runs in a temporary folder with
`save_strategy="no"`; a save strategy, `--output_dir` or `--push_to_hub` is refused.

- `--kind dirac` (default, `audit.dirac`): white-box gradient canaries; they measure each clipped update, so they
  catch noise or clipping switched off;
- `--kind ood` / `mislabelled` (`audit.canaries`): image canaries made from `--canary-source` (rows not in
  `--train`), scored by their loss under the trained model; they catch noise switched off, not clipping.

Each canary is trained on with probability 1/2, drawn from the OS (`secrets`), never from a seed: nothing on the
command line can reproduce the draw. Refused before anything is written: a `--model` that is not a model folder,
unreadable or empty data, labels outside the model's, 2k > m, input canaries without `--canary-source`, fewer
source rows than m or rows shared with `--train`, a `--canary-source` for Dirac canaries, training arguments
DPTrainingArguments refuses, neighboring other than add_remove or a unit other than the row, a save strategy or a
push.

Example (in Python; on the command line the same arguments follow `hf-dp-repr audit`):
    >>> import argparse, tempfile
    >>> from hf_dp_repr.audit.audit_cli import add_audit_parser
    >>> parser = argparse.ArgumentParser(); _ = add_audit_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["audit", "canaries", "--model", tempfile.mkdtemp(), "--train", "digits:train",
    ...                           "--canaries", "10", "--k", "6", "--", "--target_epsilon", "1"])
    >>> args.func(args)
    Traceback (most recent call last):
    SystemExit: hf-dp-repr audit canaries: --k 6 guesses 12 canaries but --canaries is 10: need 0 < 2k <= m. ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

REPORT_FILE = "privacy_audit_canaries.json"
KINDS = ("dirac", "ood", "mislabelled")
# Defaults (flags given after them win): a canary is a row added or left out, so the run claims add/remove ε; a save
# strategy or another neighbouring relation given after them is refused.
DEFAULTS = ["--save_strategy", "no", "--report_to", "none", "--neighboring", "add_remove"]
COVERED = ("Post-processing of the DP run (its released updates or weights), the public canaries and the secret "
           "inclusion draw (not written): covered by the run's DP guarantee when its ε is finite.")


def add_canary_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `canaries` under `hf-dp-repr audit` (sets `func=run_canary_audit`)."""
    p = subparsers.add_parser("canaries", help="one-run canary audit: train once with canaries, bound ε",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="folder of the starting model (save_pretrained)")
    p.add_argument("--train", required=True, metavar="DATASET", help="training set: DIR[:split] or digits:train")
    p.add_argument("--kind", choices=KINDS, default="dirac", help="dirac (gradient canaries, default), ood or "
                   "mislabelled (image canaries from --canary-source)")
    p.add_argument("--canary-source", metavar="DATASET", help="rows not in --train to make image canaries from")
    p.add_argument("--canaries", type=int, default=100, metavar="M", help="number of canaries m (default 100)")
    p.add_argument("--k", type=int, default=25, help="k guessed 'in' and k 'out', fixed before training (default 25)")
    p.add_argument("--confidence", type=float, default=0.95, help="of the lower bound (default 0.95)")
    p.add_argument("--out", default="privacy-audit", metavar="DIR", help=f"writes DIR/{REPORT_FILE}")
    p.add_argument("training_args", nargs=argparse.REMAINDER,
                   help="after `--`: DPTrainingArguments flags (--target_epsilon 1 --target_delta 1e-5 ...)")
    p.set_defaults(func=run_canary_audit)
    return p


def _fail(message: str):
    raise SystemExit(f"hf-dp-repr audit canaries: {message} Nothing written.")


def training_arguments(flags: list[str], run_dir: str):
    """DPTrainingArguments from the flags after `--`, in the temporary `run_dir` (nothing of the run is kept)."""
    from .inputs import training_flags

    args = training_flags(flags, run_dir, DEFAULTS, _fail, refused=("--output_dir",),
                          missing="give the training arguments after `--` (at least --target_epsilon or "
                                  "--noise_multiplier, and --target_delta).",
                          why="the audit's run is not kept (its model carries the canaries); the report goes to --out.")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no" or args.push_to_hub:
        _fail("the audit's run carries the canaries and is not a model to keep: leave --save_strategy and "
              "--push_to_hub out (train the model you publish without canaries).")
    if args.neighboring != "add_remove" or args.privacy_unit != "row":
        _fail("a canary is one row, added to or left out of the training set, so the audit tests add/remove of a "
              f"row; these arguments claim ε for --neighboring {args.neighboring}, --privacy_unit {args.privacy_unit}.")
    return args


def _inputs(args: argparse.Namespace, num_labels: int):
    """(training set, image canaries or None), checked."""
    from .canaries import make_canaries
    from .inputs import check_labels, fingerprints, load_audit_dataset

    train = load_audit_dataset(args.train, "--train")
    check_labels(train, "--train", num_labels)
    if args.kind == "dirac":
        if args.canary_source is not None:
            _fail("--canary-source makes image canaries (--kind ood or mislabelled); Dirac canaries are gradients.")
        return train, None
    if args.canary_source is None:
        _fail(f"--kind {args.kind} makes its canaries from --canary-source (rows not in --train, e.g. a test split).")
    source = load_audit_dataset(args.canary_source, "--canary-source")
    if "pixel_values" not in source.column_names or "pixel_values" not in train.column_names:
        _fail(f"--kind {args.kind} canaries are images (pixel_values); for text use --kind dirac.")
    if args.canaries > len(source):
        _fail(f"--canaries {args.canaries} but --canary-source has {len(source)} rows.")
    check_labels(source, "--canary-source", num_labels)
    shared = fingerprints(train) & fingerprints(source)
    if shared:
        _fail(f"{len(shared)} row(s) of --canary-source are also in --train: a canary must be new to training.")
    return train, make_canaries(source, args.canaries, args.kind, num_labels)


def audit_ceiling(args: argparse.Namespace, targs, train_rows: int) -> tuple[float, float]:
    """Before training: (the most ε the audit can certify, the ε the run will claim). The run's plan (sample rates
    and steps) on the training set plus the m/2 canaries expected in it gives the chance s that an included canary is
    sampled at least once; `bounds.one_run_ceiling` turns it into the bound of a perfect guesser."""
    from ..training.plan import plan_run
    from .bounds import one_run_ceiling

    plan = plan_run(targs, train_rows + args.canaries // 2)
    unseen = math.prod((1 - phase.sample_rate) ** phase.steps for phase in plan.phases)
    expected = sum(phase.sample_rate * phase.steps for phase in plan.phases)
    ceiling = one_run_ceiling(args.canaries, args.k, 1 - unseen, targs.target_delta, 1 - args.confidence)
    claimed = plan.planned_epsilon()
    print(f"Before training: each canary is sampled {expected:.3g} times on average ({1 - unseen:.1%} of the included "
          f"ones at least once), so {args.canaries} canaries and {2 * args.k} guesses can certify at most ε ≈ "
          f"{ceiling:.3g} at {args.confidence:.0%} confidence (claimed ε = {claimed:.3g}).")
    if ceiling < claimed < math.inf:
        print(f"WARNING: the audit cannot certify the claimed ε = {claimed:.3g} (at most {ceiling:.3g}): it cannot "
              "tell a broken run (noise or clipping off) from a correct one. Give more canaries (--canaries, --k) or "
              "more sampling (more steps or epochs, a larger batch) for the audit to mean something.", file=sys.stderr)
    return ceiling, claimed


def _train_and_guess(args: argparse.Namespace, targs) -> dict:
    from ..analysis.inputs import load_model

    model, _ = load_model(args.model, "cpu")
    train, canaries = _inputs(args, int(model.config.num_labels))
    ceiling, _ = audit_ceiling(args, targs, len(train))
    beta = 1 - args.confidence
    if canaries is None:
        from .dirac import train_with_dirac_canaries

        return {**train_with_dirac_canaries(model, targs, train, args.canaries, k=args.k, beta=beta),
                "epsilon_ceiling": ceiling}
    from .canaries import train_with_canaries

    return {**train_with_canaries(model, targs, train, canaries, k=args.k, beta=beta), "epsilon_ceiling": ceiling}


def run_canary_audit(args: argparse.Namespace) -> int:
    m, k = args.canaries, args.k
    if not (m > 0 and 0 < 2 * k <= m):
        _fail(f"--k {k} guesses {2 * k} canaries but --canaries is {m}: need 0 < 2k <= m.")
    if not 0 < args.confidence < 1:
        _fail(f"--confidence must be in (0, 1), got {args.confidence}.")
    if not Path(args.model, "config.json").is_file():
        _fail(f"--model {args.model} is not a model folder (no config.json; give a save_pretrained folder).")
    with tempfile.TemporaryDirectory(prefix="hf-dp-repr-canary-audit-") as run_dir:
        result = _train_and_guess(args, training_arguments(args.training_args, run_dir))
    keys = ("canaries", "included", "k", "guesses", "correct", "delta", "confidence", "epsilon_lower_bound",
            "epsilon_ceiling", "claimed_epsilon", "noise_multiplier", "training_examples")
    report = {"kind": args.kind, "model": str(args.model), "train": args.train, **{key: result[key] for key in keys},
              "covered_by_dp": COVERED}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    claimed = "∞" if report["claimed_epsilon"] is None else f"{report['claimed_epsilon']:.3g}"
    verdict = ("ABOVE the claim: the implementation or the accounting is broken"
               if report["claimed_epsilon"] is not None and result["epsilon_lower_bound"] > report["claimed_epsilon"]
               else "not above the claim")
    bound = result["epsilon_lower_bound"]
    print(f"{args.kind} canaries: {result['correct']} of {result['guesses']} guesses right (m = {m}), ε ≥ "
          f"{bound if math.isinf(bound) else round(bound, 3)} at {args.confidence:.0%} confidence; claimed ε = "
          f"{claimed}: {verdict}. Wrote {out / REPORT_FILE}.")
    return 0
