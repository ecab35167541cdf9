"""`make demo`: the embedded default end to end, offline, in a few minutes on 2 CPU cores.

The seeds' setting (a model pre-trained on public data of another task, then DP fine-tuned on the private task):
1. public pre-training: a 4-block ViT (random init) trained non-privately on the public 30 % of sklearn's digits
   training split, of digits 0-4 only (another task: the public model never sees a 5-9), saved with
   `save_pretrained` (into <out>/public_pretrained) and reloaded with `from_pretrained`;
2. DP training of its head (a linear probe) on the disjoint private 70 %, all ten digits, at ε = 1 and ε = 8, and a
   non-private reference (`noise_multiplier=0`), all with the same settings (recipes/configs/demo_digits.yaml);
3. the representation laws of every model on the test split;
4. a report folder <out>/report: summary.json, laws.png, the three model cards, and the table printed at the end,
   whose closing line says how far ε = 1 is above the public-only model (what the private data adds under DP).

    python recipes/demo.py [--output_dir demo_out]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

from hf_dp_repr.entry_point import CommandParser

RECIPES = Path(__file__).resolve().parents[2] / "recipes"  # the repository's recipes/ (configs)

RUNS = {  # name → the only arguments that differ between the three runs
    "dp_eps1": ["--target_epsilon", "1"],
    "dp_eps8": ["--target_epsilon", "8"],
    "non_private": ["--noise_multiplier", "0"],
}
GAIN_POINTS = 3.0  # DP ε = 1 should beat the public-only model by at least this many points: the private data helps


def main(argv: list[str] | None = None) -> dict:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="demo_out")
    parser.add_argument("--config", default=str(RECIPES / "configs" / "demo_digits.yaml"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the tiny ViT gains nothing from more, and on a busy "
                             "machine OpenMP threads spinning at barriers made each step several times slower)")
    parser.add_argument("extra", nargs="*", help="more recipe arguments, after --, applied to every run")
    opts = parser.parse_args(argv)
    import torch

    torch.set_num_threads(opts.threads)
    from transformers.utils import logging as hf_logging

    from hf_dp_repr.scripts import image_classification as recipe

    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()
    out = Path(opts.output_dir)
    start = time.time()
    rows = {}
    stages = len(RUNS) + 1
    for i, (name, differs) in enumerate(RUNS.items(), start=1):
        t0 = time.time()
        what = "public pre-training (non-private, once), then " if i == 1 else ""
        print(f"\n=== [{i}/{stages}] {name}: {what}DP fine-tuning with {' '.join(differs)} "
              f"({time.time() - start:.0f} s so far) ===", flush=True)
        metrics = recipe.main(["--config", opts.config, "--output_dir", str(out / name),
                               "--public_model_dir", str(out / "public_pretrained"), *differs, *opts.extra])
        rows[name] = _row(out / name, metrics, time.time() - t0)
    print(f"\n=== [{stages}/{stages}] report: the public model's accuracy and laws, the table "
          f"({time.time() - start:.0f} s so far) ===", flush=True)
    rows = {"public_only": _public_row(out, rows), **rows}
    summary = _report(out, rows, time.time() - start)
    return summary


def _row(run_dir: Path, metrics: dict, seconds: float) -> dict:
    ledger = json.loads((run_dir / "privacy_ledger.json").read_text())
    laws = json.loads((run_dir / "representation_law.json").read_text())["analyses"]
    final = laws[-1]
    return dict(
        epsilon=ledger["epsilon"], delta=ledger["target_delta"],
        noise_multiplier=[p["noise_multiplier"] for p in ledger.get("phases", [])] or [ledger.get("noise_multiplier")],
        accuracy=metrics["eval_accuracy"], rho_fuzziness=(final["fuzziness_law"] or {}).get("rho"),
        rho_residual=(final["residual_law"] or {}).get("rho"), seconds=round(seconds, 1), law_entry=final,
        first_law_entry=laws[0],
    )


def _public_row(out: Path, rows: dict) -> dict:
    """The publicly pre-trained model before any private data: its test accuracy and laws (train_begin analysis)."""
    import numpy as np
    import torch
    from transformers import AutoModelForImageClassification

    from hf_dp_repr.data import load_digits_dataset

    model = AutoModelForImageClassification.from_pretrained(out / "public_pretrained").eval()
    test = load_digits_dataset()["test"][:]
    with torch.no_grad():
        pred = model(pixel_values=test["pixel_values"]).logits.argmax(-1).numpy()
    first = next(iter(rows.values()))["first_law_entry"]
    return dict(epsilon=0.0, delta=None, noise_multiplier=None,
                accuracy=float(np.mean(pred == test["labels"].numpy())),
                rho_fuzziness=(first["fuzziness_law"] or {}).get("rho"),
                rho_residual=(first["residual_law"] or {}).get("rho"), seconds=None, law_entry=first)


def _report(out: Path, rows: dict, seconds: float) -> dict:
    from hf_dp_repr.analysis import RepresentationReport, plot_laws

    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    plot_laws({name: RepresentationReport.from_dict(r["law_entry"]) for name, r in rows.items()},
              report / "laws.png", title="digits, test split: public model and DP fine-tunes")
    for name in RUNS:
        shutil.copy(out / name / "README.md", report / f"model_card_{name}.md")
    gain = 100 * (rows["dp_eps1"]["accuracy"] - rows["public_only"]["accuracy"])
    gap = 100 * (rows["non_private"]["accuracy"] - rows["dp_eps1"]["accuracy"])
    summary = _summary(rows, gain, gap, seconds)
    (report / "summary.json").write_text(json.dumps(summary, indent=2, default=str, allow_nan=False))
    table = _table(rows)
    (report / "table.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nDP ε=1 is {gain:+.1f} points from the public-only model ("
          f"{'at least' if gain >= GAIN_POINTS else 'NOT'} +{GAIN_POINTS:g}: what the private data adds under DP) and "
          f"{gap:.1f} points below the non-private reference. Report: {report}/ (summary.json, laws.png, model "
          f"cards). Runs: {seconds:.0f} s.")
    return summary


def _summary(rows: dict, gain: float, gap: float, seconds: float) -> dict:
    """summary.json's content, valid JSON: the non-private reference's ε = ∞ is null, with
    `differentially_private: false` saying why."""
    runs = {}
    for name, r in rows.items():
        run = {f: v for f, v in r.items() if not f.endswith("law_entry")}
        eps = run["epsilon"]
        run["differentially_private"] = eps is not None and math.isfinite(eps)
        run["epsilon"] = eps if run["differentially_private"] else None
        runs[name] = run
    return {"runs": runs, "eps1_gain_over_public_points": gain, "private_data_helps": gain >= GAIN_POINTS,
            "eps1_gap_to_non_private_points": gap, "seconds": round(seconds, 1)}


def _table(rows: dict) -> str:
    def f(v, spec):
        return "n/a" if v is None else ("∞" if v == float("inf") else format(v, spec))

    lines = ["| run | ε spent | test accuracy | ρ fuzziness D_l | ρ residual PR_l |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "public_only":
            eps = "0 (no private data)"
        elif r["epsilon"] is None and r["noise_multiplier"] == [0]:  # the ledger stores ε = ∞ as null
            eps = "∞"
        else:
            eps = f(r["epsilon"], ".3f")
        lines.append(f"| {name} | {eps} | {f(100 * r['accuracy'], '.1f')} % | {f(r['rho_fuzziness'], '.3f')} | "
                     f"{f(r['rho_residual'], '.3f')} |")
    lines += ["", "ρ: the decay per layer of a law fitted across the layers on the test split (He & Su): separation "
              "fuzziness D_l ≈ ρ^l · D_0 (within-class spread against between-class), prediction residual PR_l ≈ "
              "ρ^(l-1) · PR_1 (1 - R² of a linear fit to the label). Smaller ρ: each layer separates the classes more."]
    return "\n".join(lines)


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("demo"))  # as recipes/*.py
