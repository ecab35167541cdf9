"""What a hyperparameter search (`search.py`) writes when it ends: the trials table (`hp_search_trials.csv`), its
plot and the summary log. A private search (tuning_data="private") shows the best trial only: the number of trials
K must stay secret for the Papernot-Steinke bound to hold."""

from __future__ import annotations

import csv
import math
import os

from transformers.utils import logging

logger = logging.get_logger(__name__)


def write_table(output_dir: str, search, study, best_trial, total: float | None) -> None:
    """`hp_search_trials.csv` and its plot: every trial of a public or held-out search, the best one only of a
    private search (the number of trials K must stay secret)."""
    os.makedirs(output_dir, exist_ok=True)
    private = search.tuning_data == "private"
    trials = {t.number: t for t in study.trials}

    def drawn(r) -> dict:  # what hp_space set, and what else the trial drew (e.g. in model_init(trial))
        t = trials.get(r["trial"])
        return {**(t.params if t is not None else {}), **r["params"]}

    keys = sorted({k for r in search.records for k in drawn(r)})
    rows = []
    for r in search.records:
        t = trials.get(r["trial"])
        if private and (best_trial is None or t is None or t.number != best_trial.number):
            continue  # the number of trials K must stay secret: only the best trial's row leaves
        shown = True
        rows.append({"trial": "best" if private else r["trial"], "state": t.state.name if t else r.get("state"),
                     **{k: drawn(r).get(k, "") for k in keys},
                     "scope": r.get("scope", ""), "sigma": r.get("sigma", ""), "sample_rate": r.get("sample_rate", ""),
                     "steps": r.get("steps", ""), "epsilon_planned": r.get("epsilon_planned", ""),
                     "epsilon_spent": r.get("epsilon_spent", ""), "epsilon_trial_rdp": r.get("epsilon_trial_rdp", ""),
                     "objective": t.value if t is not None and t.value is not None and shown else "",
                     "tuning_data": search.tuning_data,
                     "epsilon_search_total": "" if total is None else total})
    path = os.path.join(output_dir, "hp_search_trials.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["trial"])
        writer.writeheader()
        writer.writerows(rows)
    _plot(os.path.join(output_dir, "hp_search_trials.png"), rows, search.baseline.target_epsilon, total, private)


def _plot(path: str, rows: list[dict], target: float, total: float | None, private: bool) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    ax_obj, ax_eps = fig.subplots(1, 2)
    xs = list(range(len(rows)))
    scored = [(x, r["objective"]) for x, r in zip(xs, rows) if isinstance(r["objective"], float)]
    if scored:
        ax_obj.plot(*zip(*scored), "o-")
    ax_obj.set(xlabel="trial", ylabel="objective", title="objective" + (" (best trial only)" if private else ""))
    eps = [r["epsilon_spent"] if isinstance(r["epsilon_spent"], float) else 0.0 for r in rows]
    ax_eps.bar(xs, eps, label="ε of each trial")
    ax_eps.axhline(target, color="k", ls=":", label=f"target ε = {target:g}")
    if total is not None and math.isfinite(total):
        ax_eps.axhline(total, color="r", label=f"whole search ε = {total:.3g}")
    ax_eps.set(xlabel="trial", ylabel="ε", title="privacy")
    ax_eps.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def announce(search, total, best_trial, target) -> None:
    """The summary log line of a search (the best trial only, for a private search)."""
    private = search.tuning_data == "private"
    lines = [f"hyperparameter_search ({search.tuning_data} data): " + (
        "the number of trials stays secret; the best trial:" if private else f"{len(search.records)} trials")]
    for r in search.records:
        if private and (best_trial is None or r["trial"] != best_trial.number):
            continue
        eps = r.get("epsilon_spent")
        name = "best" if private else r["trial"]
        lines.append(f"  trial {name}: ε = {eps:.4f} (target {target:g}), σ = {r.get('sigma')}, "
                     f"{r.get('steps')} steps" if eps is not None else f"  trial {name}: did not train")
    if total is not None:
        lines.append(f"  whole search (Papernot-Steinke, {search.trial_count.describe()}): ε = {total:.4f} at δ = "
                     f"{search.baseline.target_delta:g}")
    else:
        lines.append(f"  whole search: not charged to the private budget (tuning_data={search.tuning_data!r})")
    if best_trial is not None:
        lines.append(f"  best trial {'' if private else best_trial.number}: {best_trial.params}")
    logger.warning("\n".join(lines))
