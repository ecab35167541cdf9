"""The demo's report folder: summary.json, table.md, the figures, the model cards, and the closing lines that say
what the measurements say about each seed's claim (`hf_dp_repr.scripts.demo` measures; this writes).

Every figure and line is computed from the test-split measurements of the finished runs; nothing here trains or
chooses a setting.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

GAIN_POINTS = 3.0  # DP ε = 1 should beat the public-only model by at least this many points: the private data helps
SPREAD_NOTE = "one run each; the spread over fresh noise: benchmarks/RESULTS.md, \"The demo's rows\""


def write(out: Path, rows: dict, titles: dict, seconds: float) -> dict:
    """Write <out>/report and print the table and closing lines; returns the summary."""
    from hf_dp_repr.analysis import RepresentationReport, plot_laws

    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    plot_laws({name: RepresentationReport.from_dict(r["law_entry"]) for name, r in rows.items()},
              report / "laws.png", title="digits, test split: public model and (DP) fine-tunes")
    plot_layers(rows, report / "fuzziness_by_layer.png")
    plot_accuracy(rows, report / "accuracy_vs_epsilon.png")
    for name in rows:
        if (out / name / "README.md").exists():
            shutil.copy(out / name / "README.md", report / f"model_card_{name}.md")
    gain = 100 * (rows["dp_eps1"]["accuracy"] - rows["public_only"]["accuracy"])
    gap = 100 * (rows["non_private"]["accuracy"] - rows["dp_eps1"]["accuracy"]) if "non_private" in rows else None
    findings = closing_lines(rows, gain, gap)
    summary = summary_of(rows, gain, gap, seconds)
    summary["findings"] = findings
    (report / "summary.json").write_text(json.dumps(summary, indent=2, default=str, allow_nan=False))
    table = table_of(rows, titles)
    (report / "table.md").write_text(table + "\n\n" + "\n".join(f"- {line}" for line in findings) + "\n")
    print("\n" + table + "\n")
    for line in findings:
        print(f"- {line}")
    print(f"\nReport: {report}/ (summary.json, table.md, fuzziness_by_layer.png, accuracy_vs_epsilon.png, laws.png, "
          f"model cards). Runs: {seconds:.0f} s.")
    return summary


def closing_lines(rows: dict, gain: float, gap: float | None) -> list[str]:
    """What the measurements say, one line per claim, each saying whether it holds here. `rows["dp_eps1"]["scope"]`
    names the headline scope at ε = 1 (default: LP→FT); the seeds' comparison reads the eps1_* rows."""
    def acc(name):
        return 100 * rows[name]["accuracy"]

    def last(name, field):
        return rows[name][field][-1]

    scope = rows["dp_eps1"].get("scope", "LP→FT")
    lines = [f"Private data under DP: ε = 1 ({scope}, the scope for ε = 1) is {gain:+.1f} points from the public-only "
             f"model ({'at least' if gain >= GAIN_POINTS else 'NOT'} +{GAIN_POINTS:g})"
             + ("" if gap is None else f" and {gap:.1f} points below the non-private reference") + "."]
    moved = [n for n in rows if n != "public_only" and rows[n]["rho_fuzziness"] != rows["public_only"]["rho_fuzziness"]]
    lines.append(f"Representations: the laws' ρ differ from the public model's for {len(moved)} of {len(rows) - 1} "
                 f"trained rows ({', '.join(moved) or 'none'}); a linear probe leaves every hidden state as it was "
                 "(CKA 1 at every layer), so only the rows that train blocks can move them.")
    if "eps1_untuned_lr" in rows and "eps1_lpft" in rows:
        tuned, untuned = acc("eps1_lpft"), acc("eps1_untuned_lr")
        worse = untuned < tuned and last("eps1_untuned_lr", "fuzziness") > last("eps1_lpft", "fuzziness")
        lines.append(f"Seed 000 (untuned DP noise degrades the features, tuned barely): at ε = 1, LP→FT at the untuned "
                     f"rate gives {untuned:.1f} % and last-layer D = {last('eps1_untuned_lr', 'fuzziness'):.3g}, at "
                     f"the tuned rate {tuned:.1f} % and D = {last('eps1_lpft', 'fuzziness'):.3g}"
                     + (f" (non-private: D = {last('non_private', 'fuzziness'):.3g})" if "non_private" in rows else "")
                     + f": {'holds' if worse else 'does not hold'} here (higher D: classes less separated).")
    if "eps1_ft" in rows and "eps1_lpft" in rows:
        ft, lpft = last("eps1_ft", "cka"), last("eps1_lpft", "cka")
        lines.append(f"Seeds 001/003 (DP fine-tuning distorts the features, a linear probe first aligns them): last-"
                     f"layer CKA with the public features {ft:.3f} without LP against {lpft:.3f} with LP→FT, accuracy "
                     f"{acc('eps1_ft'):.1f} % against {acc('eps1_lpft'):.1f} %: "
                     f"{'holds' if ft < lpft else 'does not hold'} here.")
    scopes = {scope: "dp_eps1", "LP→FT": "eps1_lpft", "FT without LP": "eps1_ft"}
    scopes = {k: v for k, v in scopes.items() if v in rows}
    if len(scopes) > 1:
        best = max(scopes, key=lambda k: acc(scopes[k]))
        lines.append("Seed 002 (which layers to train under DP): at ε = 1 "
                     + ", ".join(f"{k} {acc(v):.1f} %" for k, v in scopes.items()) + f"; best in this run: {best}.")
    lines.append(f"Measured on the 360 test images ({SPREAD_NOTE}); each ε's scope and every learning rate were "
                 "chosen beforehand on held-out private rows, never on the test split.")
    return lines


def summary_of(rows: dict, gain: float, gap: float | None, seconds: float) -> dict:
    """summary.json's content, valid JSON: the non-private reference's ε = ∞ is null, with
    `differentially_private: false` saying why."""
    runs = {}
    for name, r in rows.items():
        run = {f: v for f, v in r.items() if not f.endswith("law_entry")}
        eps = run["epsilon"]
        run["differentially_private"] = eps is not None and math.isfinite(eps) and name != "public_only"
        run["epsilon"] = eps if eps is not None and math.isfinite(eps) else None
        runs[name] = run
    return {"runs": runs, "eps1_gain_over_public_points": gain, "private_data_helps": gain >= GAIN_POINTS,
            "eps1_gap_to_non_private_points": gap, "seconds": round(seconds, 1)}


def table_of(rows: dict, titles: dict) -> str:
    def f(v, spec):
        return "n/a" if v is None else ("∞" if v == float("inf") else format(v, spec))

    lines = ["| run | what | ε spent | test accuracy | ρ fuzziness D_l | ρ residual PR_l | D_l, last layer | "
             "CKA with public, by layer |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "public_only":
            eps = "0 (no private data)"
        elif r["epsilon"] is None and not any(r["noise_multiplier"] or [1]):  # σ = 0 in every phase: ε = ∞ (null)
            eps = "∞"
        else:
            eps = f(r["epsilon"], ".3f")
        fuzz = r.get("fuzziness") or [None]
        cka = " ".join(f(v, ".2f") for v in r.get("cka", []))
        lines.append(f"| {name} | {titles.get(name, '')} | {eps} | {f(100 * r['accuracy'], '.1f')} % | "
                     f"{f(r['rho_fuzziness'], '.3f')} | {f(r['rho_residual'], '.3f')} | {f(fuzz[-1], '.3g')} | "
                     f"{cka or 'n/a'} |")
    lines += ["", "ρ: the decay per layer of a law fitted across the layers on the test split (He & Su): separation "
              "fuzziness D_l ≈ ρ^l · D_0 (within-class spread against between-class), prediction residual PR_l ≈ "
              "ρ^(l-1) · PR_1 (1 - R² of a linear fit to the label). Smaller ρ: each layer separates the classes more. "
              "CKA: linear CKA of each hidden state's [CLS] features (layer 0 = embedding output) with the public "
              "model's on the same test images; 1 = not moved."]
    return "\n".join(lines)


def plot_layers(rows: dict, path: Path) -> Path:
    """D_l (log scale) and CKA with the public model against layer, one line per row."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11.0, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for name, r in rows.items():
        style = dict(marker="o", linestyle="--" if name == "public_only" else "-", label=name)
        values = r.get("fuzziness") or []
        layers = [i for i, v in enumerate(values) if v is not None and v > 0]
        left.plot(layers, [values[i] for i in layers], **style)
        if r.get("cka"):
            right.plot(range(len(r["cka"])), r["cka"], **style)
    left.set_yscale("log")
    left.set_ylabel("separation fuzziness D$_l$ (lower: classes more separated)")
    right.set_ylabel("linear CKA with the public model's features")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer (0 = embedding output)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("digits, test split: what each way of training did to every layer")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_accuracy(rows: dict, path: Path) -> Path:
    """Test accuracy against ε: public-only at 0, each ε's headline scope at 1 and 8, LP→FT at ∞ (not private), the
    ε = 1 alternatives beside."""
    from matplotlib.figure import Figure

    ticks = {"public_only": 0, "dp_eps1": 1, "dp_eps8": 2, "non_private": 3}
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    main = [n for n in ticks if n in rows]
    ax.plot([ticks[n] for n in main], [100 * rows[n]["accuracy"] for n in main], marker="o",
            label="the scope chosen for each ε")
    others = [n for n in rows if n not in ticks]
    for i, name in enumerate(others):
        ax.plot([1 + 0.08 * (i + 1)], [100 * rows[name]["accuracy"]], marker="sD^v"[i % 4], linestyle="none",
                label=name)
    ax.set_xticks(range(4), ["0 (public only)", "ε = 1", "ε = 8", "∞ (not private)"])
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("digits: accuracy against the privacy budget")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
