"""A language recipe's models side by side, layer by layer, on held-out text: the public model (before any private
data), the DP model, and a non-private reference (the output folder of the same recipe run with `--noise_multiplier
0`, given as `--reference_model_dir`). Next-token prediction residual PR_l at every hidden state (D_l too where the
data has labels), their laws' ρ, as a table (printed, and `table.md`) and a plot (`layers.png`) in
<output_dir>/representation_comparison/: a subfolder, so never pushed (`hf_dp_repr.hub.push` sends top-level files
only). The reference saw the private data without DP: its row is for inspection, not for publishing.

    python recipes/dp_causal_lm.py --output_dir out/lm-ref --noise_multiplier 0
    python recipes/dp_causal_lm.py --output_dir out/lm-eps8 --target_epsilon 8 --compare_representations true \
        --reference_model_dir out/lm-ref
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_dp_repr.errors import RecipeArgumentError

FOLDER = "representation_comparison"


@dataclass
class ComparisonArguments:
    """The public / DP / non-private comparison at the end of a language recipe."""

    compare_representations: bool = field(default=False, metadata={
        "help": "At the end, measure PR_l (and D_l where labels exist) at every layer of the public model, the DP "
                "model and --reference_model_dir on the eval split: <output_dir>/representation_comparison/ "
                "(table.md, layers.png, comparison.json; never pushed)."})
    reference_model_dir: str | None = field(default=None, metadata={
        "help": "A non-private reference for --compare_representations: the output folder of this recipe run with "
                "--noise_multiplier 0 and otherwise the same arguments. It saw the private data without DP: its "
                "row is for inspection, not for publishing."})
    comparison_max_examples: int | None = field(default=256, metadata={
        "help": "Compare on at most this many eval rows (blocks or conversations)."})


def check_arguments(margs: Any, targs: Any = None) -> None:
    """Before any work: a reference needs the comparison, and must be a folder; no comparison of a sharded model
    (it runs on the main process alone, and a sharded forward needs every process)."""
    if margs.compare_representations and getattr(targs, "fsdp", None):
        raise RecipeArgumentError("--compare_representations with --fsdp: the comparison runs on the main process "
                                  "alone; compare the saved models with `hf-dp-repr analyze` instead.")
    ref = margs.reference_model_dir
    if ref and not margs.compare_representations:
        raise RecipeArgumentError("--reference_model_dir is only read by --compare_representations; set "
                                  "--compare_representations true or drop it.")
    if ref and not os.path.isdir(ref):
        raise RecipeArgumentError(f"--reference_model_dir {ref}: no such folder; give the output folder of this "
                                  "recipe run with --noise_multiplier 0.")


def reference_label(ref_dir: str) -> str:
    """'non-private reference' when the folder's ledger says so, else the reference's ε."""
    ledger = Path(ref_dir, "privacy_ledger.json")
    if not ledger.exists():
        return "reference (no ledger)"
    eps = json.loads(ledger.read_text()).get("epsilon")
    return "non-private reference" if eps is None or not math.isfinite(eps) else f"reference (ε = {eps:.3g})"


def compare(models: dict[str, Callable[[], Any]], dataset: Any, out_dir: str | os.PathLike, *, task: str = "causal-lm",
            max_examples: int | None = 256, title: str = "") -> dict:
    """Analyse each model (name → a function loading it) on `dataset`; write and print the table and plot.
    Returns {name: RepresentationReport.to_dict()}."""
    from hf_dp_repr.analysis import analyze_representations, plot_laws

    reports = {}
    for name, load in models.items():
        model = load()
        model.eval()
        reports[name] = analyze_representations(model, dataset, task=task, max_examples=max_examples, progress=False)
    folder = Path(out_dir, FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    plot_laws(reports, folder / "layers.png", title=title or f"{task}, held-out data: public, DP and reference")
    table = table_of(reports)
    (folder / "table.md").write_text(table + "\n")
    (folder / "comparison.json").write_text(json.dumps({n: r.to_dict() for n, r in reports.items()}, indent=2))
    print(f"\n{table}\n(figure: {folder / 'layers.png'})", flush=True)
    return {n: r.to_dict() for n, r in reports.items()}


def table_of(reports: dict) -> str:
    """One row per model: PR_l at every layer and its ρ; D_l and its ρ when measured."""
    layers = max(r.num_layers for r in reports.values())
    fuzzy = any(r.fuzziness is not None for r in reports.values())
    head = ["model", "positions", *(f"PR_{i}" for i in range(layers)), "ρ PR_l"] + (["ρ D_l"] if fuzzy else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in reports.items():
        withheld = "residual" in r.unreliable
        values = ["withheld" if withheld else f"{v:.4f}" for v in r.residual]
        rho = "withheld" if withheld or r.residual_law is None else f"{r.residual_law.rho:.4f}"
        cells = [name, str(r.num_positions), *values, rho]
        if fuzzy:
            cells.append("n/a" if r.fuzziness_law is None else f"{r.fuzziness_law.rho:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "PR_l: 1 - R² of a least-squares fit from layer l's hidden state to the next token as a class (its "
              "one-hot over the vocabulary, a fixed 256-column sketch of it for larger vocabularies; He & Su's "
              "next-token prediction), on the held-out rows; lower = more of it is linearly readable there. ρ: its "
              "decay per layer (PR_l ≈ ρ^(l-1) · PR_1). The reference saw the private data without DP: inspect, do "
              "not publish."]
    return "\n".join(lines)
