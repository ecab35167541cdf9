"""`hf-dp-repr audit`: membership inference against a saved DP run → a JSON report and a log-log ROC plot.

    hf-dp-repr audit --model out/vit-dp-eps1 --members data/private --non-members digits:test --out audit/
    hf-dp-repr audit --model out/run --members data/private --non-members data/heldout:test \\
        --reference-model out/ref-a --reference-model out/ref-b --out audit/
    hf-dp-repr audit canaries ...   (the one-run canary audit: `canary_cli`)
    hf-dp-repr audit exposure ...   (canary exposure of a causal LM, without and with DP: `exposure_cli`)

Datasets: `digits:train` / `digits:test` (sklearn's digits, offline, the split `load_digits_dataset` makes), or a
directory written by `save_to_disk` (a `Dataset`, or a `DatasetDict` as `DIR:split`), with `labels` (or `label`)
and model inputs (`pixel_values`, or `input_ids` [+ `attention_mask`]). The members must be the examples the
model trained on (all of them, or some), the non-members examples from the same distribution that it did not see.

Every check comes before anything is written: the model folder must hold `privacy_ledger.json` (the audit is read
against the claimed ε); no more members than the ledger's n (`check_members`); both sets non-empty; no example
in both; both sets and the model on one label space.

The report is evidence computed on the private members, outside DP-SGD: the DP guarantee does not cover it.
`hf-dp-repr push` never uploads it; publish it only if you decide to.

Example (in Python; on the command line the same arguments follow `hf-dp-repr audit`):
    >>> import argparse, json, tempfile
    >>> from hf_dp_repr.audit.audit_cli import add_audit_parser
    >>> folder = tempfile.mkdtemp()
    >>> from hf_dp_repr.tiny import tiny_vit; tiny_vit().save_pretrained(folder)
    >>> parser = argparse.ArgumentParser(); _ = add_audit_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["audit", "--model", folder, "--members", "digits:train", "--non-members",
    ...                           "digits:test", "--out", folder + "/audit"])
    >>> args.func(args)
    Traceback (most recent call last):
    SystemExit: hf-dp-repr audit: ... has no privacy_ledger.json: ... Nothing written.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..privacy.ledger import LEDGER_FILE
from .inputs import check_labels, fail, fingerprints, load_audit_dataset
from .mia import calibrated_scores, classification_losses, plot_roc, roc_metrics

REPORT_FILE, PLOT_FILE = "privacy_audit.json", "privacy_audit_roc.png"
NOT_COVERED = ("Computed on the private training examples (members) outside DP-SGD: NOT covered by the DP "
               "guarantee. hf-dp-repr push does not upload it; publish it only if you choose to.")


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `audit` subcommand on an argparse `subparsers` object (sets `func=run_audit`)."""
    p = subparsers.add_parser("audit", help="membership inference against a saved DP run (report beside its ε); "
                              "`audit canaries`: the one-run canary audit; `audit exposure`: canary exposure of a "
                              "causal LM", description=__doc__.split("\n\n")[0])
    # required unless `audit canaries` is given (argparse cannot make them conditional): checked by run_audit
    p.add_argument("--model", help="the run's folder (DPTrainer output_dir with privacy_ledger.json)")
    p.add_argument("--members", metavar="DATASET",
                   help="examples it trained on (its private training set, or part of it): DIR[:split] or digits:train")
    p.add_argument("--non-members", metavar="DATASET", help="examples it did not see, same distribution")
    p.add_argument("--reference-model", action="append", default=[], metavar="PATH",
                   help="a model trained like the target on other data (none of the audited examples), for the "
                   "calibrated attack; repeat for several")
    p.add_argument("--out", default="privacy-audit", metavar="DIR", help=f"writes DIR/{REPORT_FILE} and the ROC PNG")
    p.add_argument("--batch-size", type=int, default=128)
    p.set_defaults(func=run_audit)
    from .canary_cli import add_canary_parser
    from .exposure_cli import add_exposure_parser

    kinds = p.add_subparsers(dest="audit_kind", metavar="{canaries,exposure}")
    add_canary_parser(kinds)
    add_exposure_parser(kinds)
    return p


def read_claim(model_dir: str) -> dict:
    """The claimed (ε, δ) of the run in `model_dir`, from its ledger; refuse a folder without one."""
    path = Path(model_dir) / LEDGER_FILE
    if not path.is_file():
        fail(f"{model_dir} has no {LEDGER_FILE}: the audit compares the attack with the ε the run claims, so it "
              "needs a run saved by DPTrainer (trainer.save_model()). Nothing written.")
    try:
        ledger = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        fail(f"{path} is not valid JSON ({err}). Nothing written.")
    eps = ledger.get("epsilon")
    return {"epsilon": math.inf if eps is None else float(eps), "delta": ledger.get("target_delta"),
            "accountant": ledger.get("accountant"), "neighboring": ledger.get("neighboring", "add_remove"),
            "dataset_size": ledger.get("dataset_size"), "privacy_unit": ledger.get("privacy_unit", "row")}


def check_members(members, claim: dict) -> None:
    """Refuse more members than the run trained on (`claim`: `read_claim`'s; n = the ledger's `dataset_size`,
    rows or units of `privacy_unit`): some would not be members, and the attack would score them as if they were.

    Fewer is fine (a sample of the members). The ledger holds no fingerprint of the training set (published with
    the model, one would tell the private set from its neighbours), so equal counts cannot prove equal sets.

        >>> from datasets import Dataset
        >>> check_members(Dataset.from_dict({"labels": [0] * 1437}), {"dataset_size": 719, "privacy_unit": "row"})
        Traceback (most recent call last):
        hf_dp_repr.errors.AuditDataError: --members has 1437 rows but the run trained on n = 719 ...
    """
    from ..errors import AuditDataError

    n, unit = claim.get("dataset_size"), claim.get("privacy_unit", "row")
    if n is None:
        return  # a ledger written before dataset_size was recorded: nothing to compare
    if unit == "row":
        count, what = len(members), "rows"
    elif unit in members.column_names:
        count, what = len(set(members[unit])), f"distinct {unit} values"
    else:
        raise AuditDataError(f"--members has no {unit!r} column, the run's unit of privacy (its ledger counts n = {n} "
                             "units): add the column so the members can be checked against n.")
    if count > n:
        raise AuditDataError(
            f"--members has {count} {what} but the run trained on n = {n} (dataset_size in its {LEDGER_FILE}): at "
            f"least {count - n} of them were never trained on, and the attack would count them as members. Pass the "
            "private training set itself (or part of it): a recipe that pre-trains on a public part of the split "
            "trains under DP on the rest only; for an image or text recipe run, `hf-dp-repr audit --run OUTPUT_DIR` "
            "rebuilds its members and non-members from its run_info.json.")


def check_sets(members, non_members, num_labels: int) -> None:
    """Refuse overlapping sets and label spaces that differ between the sets or from the model's."""
    names = [getattr(d.features.get("labels"), "names", None) for d in (members, non_members)]
    if names[0] and names[1] and names[0] != names[1]:
        fail(f"members and non-members have different label spaces ({names[0]} vs {names[1]}). Nothing written.")
    for flag, data, declared in (("--members", members, names[0]), ("--non-members", non_members, names[1])):
        if declared and len(declared) != num_labels:
            fail(f"{flag} declares {len(declared)} classes but the model has {num_labels} labels. Nothing written.")
        check_labels(data, flag, num_labels)
    shared = fingerprints(members) & fingerprints(non_members)
    if shared:
        fail(f"{len(shared)} example(s) are both members and non-members; the sets must be disjoint. Nothing written.")


def run_audit(args: argparse.Namespace) -> int:
    from ..errors import AuditDataError

    missing = [f for f in ("model", "members", "non_members") if getattr(args, f) is None]
    if missing:
        fail(f"{', '.join('--' + f.replace('_', '-') for f in missing)} required (membership inference), or "
              "--run OUTPUT_DIR (a recipe run), or `hf-dp-repr audit canaries ...` for the canary audit. Nothing "
              "written.")
    claim = read_claim(args.model)
    members = load_audit_dataset(args.members, "--members")
    try:
        check_members(members, claim)
    except AuditDataError as err:
        fail(f"{err} Nothing written.")
    non_members = load_audit_dataset(args.non_members, "--non-members")
    from ..analysis.inputs import load_model

    model, _ = load_model(args.model, "cpu")
    num_labels = int(model.config.num_labels)
    check_sets(members, non_members, num_labels)
    references = []
    for path in args.reference_model:
        ref, _ = load_model(path, "cpu")
        if int(ref.config.num_labels) != num_labels:
            fail(f"--reference-model {path} has {ref.config.num_labels} labels, the model {num_labels}. "
                  "Nothing written.")
        references.append(ref)

    losses = {name: classification_losses(model, d, args.batch_size) for name, d in
              (("members", members), ("non_members", non_members))}
    curves = {"loss": roc_metrics(-losses["members"], -losses["non_members"])}
    if references:
        ref_losses = {name: [classification_losses(r, d, args.batch_size) for r in references]
                      for name, d in (("members", members), ("non_members", non_members))}
        curves["calibrated"] = roc_metrics(calibrated_scores(losses["members"], ref_losses["members"]),
                                           calibrated_scores(losses["non_members"], ref_losses["non_members"]))
    report = {"model": str(args.model), "claimed_epsilon": None if math.isinf(claim["epsilon"]) else claim["epsilon"],
              "claimed_delta": claim["delta"], "accountant": claim["accountant"], "neighboring": claim["neighboring"],
              "members": len(members), "non_members": len(non_members), "ledger_n": claim["dataset_size"],
              "reference_models": args.reference_model,
              "attacks": {k: {m: v[m] for m in ("auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr")}
                          for k, v in curves.items()},
              "mean_loss": {k: float(v.mean()) for k, v in losses.items()}, "not_covered_by_dp": NOT_COVERED}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    eps = "∞" if math.isinf(claim["epsilon"]) else f"{claim['epsilon']:.3g}"
    plot_roc(curves, str(out / PLOT_FILE), title=f"Membership inference ROC (claimed ε = {eps})")
    for name, m in report["attacks"].items():
        print(f"{name} attack: AUC {m['auc']:.3f}, TPR {m['tpr_at_1pct_fpr']:.3f} at 1% FPR, "
              f"{m['tpr_at_0.1pct_fpr']:.3f} at 0.1% FPR (claimed ε = {eps}, δ = {claim['delta']})")
    print(f"wrote {out / REPORT_FILE} and {out / PLOT_FILE}. {NOT_COVERED}")
    return 0
