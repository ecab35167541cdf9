"""`hf-dp-repr` command line.

    hf-dp-repr privacy --sample-rate 0.01 --noise-multiplier 1.1 --steps 10000 --delta 1e-5
    hf-dp-repr privacy --sample-rate 0.01 --target-epsilon 8 --steps 10000 --delta 1e-5 --accountant rdp
    hf-dp-repr privacy --sample-rate 0.01 --target-attack-tpr-at-fpr 0.05@0.01 --steps 1000 --delta 1e-5

    hf-dp-repr analyze --model out/ --dataset digits --out report/

    hf-dp-repr info out/   (a saved run's ε, δ, unit, steps and attack bounds, from its privacy_ledger.json)

    hf-dp-repr push out/ --hub_model_id me/name [--private] [--revision BRANCH] [--dry-run]

    hf-dp-repr train image --output_dir out/digits --target_epsilon 1 --target_delta 1e-4   (also: lm, text, sft, dpo)

    hf-dp-repr audit --model out/ --members private_split/ --non-members digits:test --out audit/
    hf-dp-repr audit --run out/ --out audit/   (a recipe run: members and non-members rebuilt from run_info.json)
    hf-dp-repr audit exposure --out audit/ -- --target_epsilon 1 --target_delta 1e-5   (canary exposure, LM)

    hf-dp-repr synth --config recipes/configs/synth_stdlib_topics_eps4.yaml   (DP synthetic text)

`privacy` plans a DP-SGD run (like TF Privacy's compute_dp_sgd_privacy): it prints JSON with the ε that
`steps` Poisson-sampled steps spend, or the σ (`noise_multiplier`) calibrated to spend `--target-epsilon` (or to
meet `--target-attack-tpr-at-fpr`), and what that means for an attacker (`attack_bounds`): the largest true-positive
rate of any membership test at false-positive rates 0.1 %, 1 % and 10 %, and the largest advantage TPR − FPR, for
the --neighboring relation.

`push` uploads a finished run (a DPTrainer output_dir) through the same allow-list as every other push: weights,
tokenizer / processor files, eval metrics, representation laws, `privacy_ledger.json` and the DP card, refreshed
from the ledger first. It refuses a folder without a ledger; login and write access are checked before anything
is written. The token comes from `hf auth login` or HF_TOKEN. `--dry-run` prints the card and the files that
would be pushed, and writes and sends nothing (no login needed).

Each command imports what it needs when it runs, and `main` sets up the process first (`hf_dp_repr.entry_point`),
before anything imports torch. `hf-dp-repr --help`, a mistyped command or option, and `hf-dp-repr privacy` (the
accountants: dp_accounting, no Opacus) import neither torch nor transformers (tests/test_cli_startup.py). Argument
errors are one line naming the argument and the closest valid one, exit code 2 (`entry_point.CommandParser`).

Adding a subcommand (the pattern every command follows): one entry in `COMMANDS`, its one-line help and the
"module:function" that adds its full parser (`def add_x_parser(subparsers)`, which calls
`subparsers.add_parser("x", ...)` and `set_defaults(func=run_x)`). Put that function in a module that imports
nothing heavy at module level (the run function imports what the command needs): `main` imports it only when
`x` is the command given; `--help` lists the command from `COMMANDS` without importing it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .entry_point import CommandParser, prepare_entry_point
from .privacy.accounting import target_epsilon_problem  # light: `hf-dp-repr privacy` loads no torch


def _target_epsilon(text: str) -> float:
    value = float(text)
    if problem := target_epsilon_problem(value):
        raise argparse.ArgumentTypeError(problem.replace("noise_multiplier=0", "--noise-multiplier 0")
                                         .replace("target_epsilon", "--target-epsilon"))
    return value


def _attack_target(text: str):
    from .errors import DPConfigError
    from .privacy.attack_rates import AttackTarget

    try:
        return AttackTarget.parse(text, name="--target-attack-tpr-at-fpr")
    except DPConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _sample_rate(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = full batch), got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def add_privacy_parser(subparsers) -> None:
    from .privacy.accountants import ACCOUNTANTS, NEIGHBORING_RELATIONS

    p = subparsers.add_parser("privacy", help=COMMANDS["privacy"][0],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample-rate", type=_sample_rate, required=True,
                   help="Poisson sampling rate q = batch / n (1: full batch, no amplification).")
    p.add_argument("--steps", type=int, required=True, help="Number of DP-SGD steps.")
    p.add_argument("--delta", type=_probability, required=True, help="δ of the (ε, δ) guarantee.")
    noise = p.add_mutually_exclusive_group(required=True)
    noise.add_argument("--noise-multiplier", type=float, help="σ: noise std / clipping norm.")
    noise.add_argument("--target-epsilon", type=_target_epsilon, help="ε to reach: σ is calibrated.")
    noise.add_argument("--target-attack-tpr-at-fpr", type=_attack_target, metavar="TPR@FPR",
                       help="σ is calibrated so that no membership test reaches more than this TPR at this FPR "
                            "(e.g. 0.05@0.01), as DPTrainingArguments.target_attack_tpr_at_fpr.")
    p.add_argument("--accountant", default="pld", help=f"one of {tuple(ACCOUNTANTS)}: dp_accounting's pld (default, "
                   "as DPTrainingArguments), Opacus' prv or rdp, or one added by `register_accountant` ('gdp' is "
                   "refused: it under-reports ε).")
    p.add_argument("--neighboring", choices=NEIGHBORING_RELATIONS, default=None,
                   help="replace_one or add_remove; default as DPTrainingArguments: replace_one with pld (n is "
                        "published beside ε), add_remove with prv/rdp (they compute nothing else).")
    p.set_defaults(func=run_privacy)


def run_privacy(args: argparse.Namespace) -> int:
    from .privacy.accountants import ACCOUNTANTS, REFUSED, accountants_for, default_neighboring
    from .privacy.accounting import calibrate_for_attack, calibrate_noise_multiplier, compute_epsilon
    from .privacy.attack_rates import attack_rates

    if args.steps <= 0:
        raise SystemExit("hf-dp-repr privacy: --steps must be > 0")
    if args.accountant in REFUSED:
        raise SystemExit(f"hf-dp-repr privacy: {REFUSED[args.accountant]}")
    if args.accountant not in ACCOUNTANTS:
        raise SystemExit(f"hf-dp-repr privacy: unknown --accountant {args.accountant!r}; use one of "
                         f"{tuple(ACCOUNTANTS)}.")
    if args.neighboring is None:  # the trainer's default (DPTrainingArguments.neighboring)
        args.neighboring = default_neighboring(args.accountant)
    if args.accountant not in (able := accountants_for(args.neighboring)):
        raise SystemExit(f"hf-dp-repr privacy: --neighboring {args.neighboring} needs --accountant "
                         f"{' or '.join(able)}.")
    result = {"sample_rate": args.sample_rate, "steps": args.steps, "delta": args.delta, "accountant": args.accountant,
              "neighboring": args.neighboring}
    if args.target_epsilon is not None:
        try:
            sigma = calibrate_noise_multiplier(args.target_epsilon, args.delta, args.sample_rate, args.steps,
                                               args.accountant, args.neighboring)
        except ValueError as e:
            raise SystemExit(f"hf-dp-repr privacy: {e}") from None
        result["target_epsilon"] = args.target_epsilon
    elif args.target_attack_tpr_at_fpr is not None:
        target = args.target_attack_tpr_at_fpr
        try:
            sigma = calibrate_for_attack(target, [], args.sample_rate, args.steps, args.neighboring)
        except ValueError as e:
            raise SystemExit(f"hf-dp-repr privacy: {e}") from None
        result["target_attack_tpr_at_fpr"] = str(target)
    else:
        if not (args.noise_multiplier >= 0 and math.isfinite(args.noise_multiplier)):
            raise SystemExit("hf-dp-repr privacy: --noise-multiplier must be >= 0 and finite")
        sigma = args.noise_multiplier
    result["noise_multiplier"] = sigma
    result["epsilon"] = compute_epsilon([(sigma, args.sample_rate, args.steps)], args.delta, args.accountant,
                                        args.neighboring)
    # what the guarantee means for a membership attacker, from the run's privacy loss distribution
    rates = attack_rates([(sigma, args.sample_rate, args.steps)], args.neighboring)
    result["attack_bounds"] = {**rates.to_dict(), "in_words": rates.describe()}
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


def add_push_parser(subparsers) -> None:
    p = subparsers.add_parser("push", help=COMMANDS["push"][0],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", help="The run's folder (DPTrainer's output_dir, with privacy_ledger.json).")
    p.add_argument("--hub_model_id", required=True, help="Repository to push to: me/name (or name).")
    p.add_argument("--private", action="store_true", help="Create the repository as private (if it is new).")
    p.add_argument("--revision", default=None, help="Branch to push to (default: main).")
    p.add_argument("--commit_message", default="DP-SGD run (hf-dp-repr)")
    p.add_argument("--dry-run", action="store_true", help="Print the model card and the files that would be pushed; "
                   "write and send nothing.")
    p.set_defaults(func=run_push)


def run_push(args: argparse.Namespace) -> int:
    from .errors import HubAccessError
    from .hub.push import files_to_push, push_run_folder

    try:
        info = push_run_folder(args.output_dir, args.hub_model_id, private=args.private or None,
                               revision=args.revision, commit_message=args.commit_message, dry_run=args.dry_run)
    except (ValueError, HubAccessError) as err:
        raise SystemExit(str(err)) from None
    if args.dry_run:
        print(info.content)
        print(f"dry run: would push {', '.join(files_to_push(args.output_dir))} to {args.hub_model_id} (README.md as "
              "above); nothing was written or sent")
        return 0
    print(f"pushed {', '.join(files_to_push(args.output_dir))} to {getattr(info, 'commit_url', info)}")
    return 0


def add_info_parser(subparsers) -> None:
    p = subparsers.add_parser("info", help=COMMANDS["info"][0], description=COMMANDS["info"][0])
    p.add_argument("run_dir", help="A saved run: DPTrainer's output_dir or one of its checkpoints (the folder that "
                   "holds privacy_ledger.json).")
    p.set_defaults(func=run_info)


def run_info(args: argparse.Namespace) -> int:
    """Print the run's guarantee as JSON, from its ledger alone (the plan and the steps taken: public quantities;
    no data is read): ε from the accountant the run used, δ, the unit, the steps, and the attack bounds."""
    import glob
    import os

    from .errors import LedgerError
    from .privacy.ledger import LEDGER_FILE, PrivacyLedger

    path = os.path.join(args.run_dir, LEDGER_FILE)
    if not os.path.isfile(path):
        found = sorted(glob.glob(os.path.join(args.run_dir, "checkpoint-*", LEDGER_FILE)))
        hint = (f"; its checkpoints have one: hf-dp-repr info {os.path.dirname(found[-1])}" if found
                else ": not the output_dir of a finished DP run")
        print(f"hf-dp-repr info: error: no {path}{hint}", file=sys.stderr)
        return 2
    try:
        ledger = PrivacyLedger.load(args.run_dir)
    except LedgerError as err:
        print(f"hf-dp-repr info: error: {err}", file=sys.stderr)
        return 1
    plan, eps = ledger.plan, ledger.epsilon()
    result = {"run_dir": args.run_dir, "epsilon": eps if math.isfinite(eps) else None, "delta": plan.target_delta,
              "neighboring": plan.neighboring, "accountant": plan.accountant, "privacy_unit": plan.privacy_unit,
              "units": plan.dataset_size, "steps": ledger.steps_done, "planned_steps": plan.planned_steps,
              "phases": [dict(vars(phase)) for phase in plan.phases], "randomness": plan.randomness}
    if plan.target_epsilon is not None or plan.target_attack_tpr_at_fpr is not None:
        result["target"] = plan.target_attack_tpr_at_fpr or plan.target_epsilon
    if math.isfinite(eps):
        rates = ledger.attack_rates()
        result["attack_bounds"] = {**rates.to_dict(), "in_words": rates.describe()}
    result["summary"] = ledger.summary()
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


TRAIN_SCRIPTS = {"image": "image_classification", "lm": "causal_lm", "text": "text_classification",
                 "sft": "sft", "dpo": "dpo"}  # TRL's SFTTrainer / DPOTrainer under DP (the `trl` extra)


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help=COMMANDS["train"][0])
    p.add_argument("task", choices=sorted(TRAIN_SCRIPTS))
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's arguments (--config file.yaml, ...)")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    return _run_recipe(TRAIN_SCRIPTS[args.task], f"hf-dp-repr train {args.task}", args.recipe_args)


def _run_recipe(name: str, prog: str, argv: list[str]) -> int:
    """The recipes' one runner (scripts.runner; by name: scripts is cli's peer stage): an argument error is one
    line, exit code 2; `--help` answers at once, DP arguments first."""
    import importlib

    return importlib.import_module("hf_dp_repr.scripts.runner").run_recipe(name, prog, argv)


def add_audit_parser(subparsers) -> None:
    """`audit` (hf_dp_repr.audit.audit_cli) with `--run OUTPUT_DIR`: the recipe's split is rebuilt by the recipes
    (hf_dp_repr.scripts.run_split), which the audit stage below them cannot import."""
    from .audit.audit_cli import add_audit_parser as add_membership_audit

    p = add_membership_audit(subparsers)
    p.add_argument("--run", metavar="OUTPUT_DIR",
                   help="a recipe run's output_dir: audits its model on its members (the private training rows) and "
                   "non-members (its evaluation set), rebuilt from its run_info.json; replaces --model, --members "
                   "and --non-members")
    p.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    from .audit.audit_cli import run_audit as run_membership_audit
    from .audit.inputs import fail

    if args.run is not None:
        given = [f"--{f.replace('_', '-')}" for f in ("model", "members", "non_members") if getattr(args, f)]
        if given:
            fail(f"--run rebuilds the model, members and non-members from the run: drop {', '.join(given)}. "
                 "Nothing written.")
        import importlib

        from .errors import AuditDataError

        rebuild_members = importlib.import_module("hf_dp_repr.scripts.run_split").rebuild_members  # a peer stage
        try:
            args.members, args.non_members = rebuild_members(args.run)
        except AuditDataError as err:
            fail(f"{err} Nothing written.")
        args.model = args.run
    return run_membership_audit(args)


def add_synth_parser(subparsers) -> None:
    # prefix_chars="+": every --flag after `synth` is the recipe's (its --help included), not this parser's
    p = subparsers.add_parser("synth", add_help=False, prefix_chars="+", help=COMMANDS["synth"][0])
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's arguments (--config file.yaml, ...)")
    p.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    return _run_recipe("synth", "hf-dp-repr synth", args.recipe_args)


# name: (its line in `hf-dp-repr --help`, "module:function" that adds its parser; imported only when it runs)
COMMANDS = {
    "privacy": ("ε of a planned DP-SGD run, or the σ that reaches a target ε.", "hf_dp_repr.cli:add_privacy_parser"),
    "info": ("A saved run's guarantee from its ledger: ε, δ, unit, steps and what they allow a membership attacker.",
             "hf_dp_repr.cli:add_info_parser"),
    "push": ("Push a finished DP run (its allow-listed files and DP card) to the Hub.",
             "hf_dp_repr.cli:add_push_parser"),
    "train": ("Run a recipe (hf_dp_repr.scripts): DP fine-tuning of an image classifier, a causal LM, a text "
              "classifier or a chat model (sft, dpo: with TRL); `hf-dp-repr train image --help` lists its arguments.",
              "hf_dp_repr.cli:add_train_parser"),
    "analyze": ("separation fuzziness / prediction residual laws of models",
                "hf_dp_repr.analysis.analyze_cli:add_analyze_parser"),
    "audit": ("membership inference against a saved DP run (report beside its ε); `audit canaries`: the one-run "
              "canary audit; `audit exposure`: canary exposure with and without DP",
              "hf_dp_repr.cli:add_audit_parser"),
    "synth": ("DP synthetic text (hf_dp_repr.scripts.synth): DP fine-tune a causal LM on labelled text with control "
              "codes, sample N rows per label; `hf-dp-repr synth --help` lists its arguments.",
              "hf_dp_repr.cli:add_synth_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser: `command`'s full parser (its module imported), every other command as its help line."""
    import importlib

    parser = CommandParser(prog="hf-dp-repr", description="Differentially private fine-tuning tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (help_line, adder) in COMMANDS.items():
        if name == command:
            module, function = adder.split(":")
            getattr(importlib.import_module(module), function)(subparsers)
        else:
            subparsers.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    prepare_entry_point()  # before any command imports torch
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
