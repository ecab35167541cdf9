"""The LP→FT budget curve (seeds 001/003): accuracy against the share of ε given to the linear-probing phase
(`lp_epsilon_fraction`) and the share of steps it takes (`lp_steps`), one DP run per point.

Every point is a full run that spends the target ε on its own. Choosing the best split from these runs is a
search: if the runs train on the private data, the choice is not covered by any single run's ε. The sweep reports
what all its runs compose to (the real accountant, on their concatenated schedules) as an upper bound of that
cost; run it on public or held-out data to choose a split for free, then train once on the private data.

Example (two points of a few steps each: one σ for both phases, and 30 % of ε to the probe):
    >>> from hf_dp_repr import DPTrainingArguments
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> from hf_dp_repr.tuning.budget_split import sweep_budget_split
    >>> ds = load_digits_dataset()
    >>> args = DPTrainingArguments(output_dir="/tmp/split-doc", target_epsilon=4.0, target_delta=1e-4,
    ...     per_device_train_batch_size=64, max_steps=4, trainable_blocks=1, report_to="none", save_strategy="no",
    ...     disable_tqdm=True, logging_strategy="no", accountant="rdp")
    >>> result = sweep_budget_split(tiny_vit, args, ds["train"].select(range(256)), ds["test"].select(range(64)),
    ...                             fractions=[0.3], lp_steps=[0.5], progress=False)  # doctest: +ELLIPSIS
    {...}
    >>> [(r["lp_epsilon_fraction"], round(r["epsilon"], 1)) for r in result.rows]
    [(None, 4.0), (0.3, 4.0)]
"""

from __future__ import annotations

import copy
import csv
import os
from dataclasses import dataclass

import numpy as np

from ..metrics import accuracy_metrics
from ..privacy.accounting import compute_epsilon


@dataclass
class BudgetSplitResult:
    rows: list[dict]
    best: dict
    composed_epsilon: float  # all runs composed: what choosing among them costs at most, if they saw private data

    def summary(self) -> str:
        b = self.best
        return (f"best split: lp_steps={b['lp_steps']}, lp_epsilon_fraction={b['lp_epsilon_fraction']} → accuracy "
                f"{b['accuracy']:.4f} at ε={b['epsilon']:.3f}; each run spends the target ε; the {len(self.rows)} "
                f"runs compose to ε={self.composed_epsilon:.3f} (the cost of choosing among them on private data)")


def sweep_budget_split(model_init, base_args, train_dataset, eval_dataset, fractions=(0.1, 0.3, 0.5, 0.7, 0.9),
                       lp_steps=(0.2, 0.5), include_single_sigma: bool = True, progress: bool = True,
                       **trainer_kwargs) -> BudgetSplitResult:
    """One DP run per (lp_steps, lp_epsilon_fraction); `None` in the fractions (added when
    `include_single_sigma`) is one σ for both phases, calibrated on their composition."""
    from tqdm.auto import tqdm

    from ..training.trainer import DPTrainer

    grid = [(s, f) for s in lp_steps for f in ([None] if include_single_sigma else []) + list(fractions)]
    rows, history = [], []
    for steps, fraction in tqdm(grid, desc="LP/FT budget split", disable=not progress):
        args = copy.deepcopy(base_args)
        args.lp_steps, args.lp_epsilon_fraction = steps, fraction
        args.output_dir = os.path.join(base_args.output_dir, f"lp{steps}_eps{fraction}")
        trainer = DPTrainer(model=model_init(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                            compute_metrics=trainer_kwargs.pop("compute_metrics", accuracy_metrics()), **trainer_kwargs)
        trainer.train()
        metrics = trainer.evaluate()
        led = trainer.ledger
        history += led.history
        rows.append({"lp_steps": steps, "lp_epsilon_fraction": fraction, "accuracy": metrics["eval_accuracy"],
                     "epsilon": led.epsilon(), **{f"epsilon_{k}": v for k, v in led.epsilon_by_phase().items()},
                     "sigma": " / ".join(f"{p.noise_multiplier:.4f}" for p in led.plan.phases)})
    best = max(rows, key=lambda r: r["accuracy"])
    composed = compute_epsilon(history, base_args.target_delta, base_args.accountant, base_args.neighboring)
    return BudgetSplitResult(rows, best, composed)


def write_budget_split(result: BudgetSplitResult, output_dir: str) -> tuple[str, str]:
    """`budget_split.csv` and the utility curve `budget_split.png` (accuracy against the LP share of ε)."""
    from matplotlib.figure import Figure

    os.makedirs(output_dir, exist_ok=True)
    csv_path, png_path = os.path.join(output_dir, "budget_split.csv"), os.path.join(output_dir, "budget_split.png")
    keys = list(dict.fromkeys(k for r in result.rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(result.rows)
    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.subplots()
    for steps in dict.fromkeys(r["lp_steps"] for r in result.rows):
        pts = sorted((r["lp_epsilon_fraction"], r["accuracy"]) for r in result.rows
                     if r["lp_steps"] == steps and r["lp_epsilon_fraction"] is not None)
        line = ax.plot(*zip(*pts), "o-", label=f"lp_steps={steps}")[0] if pts else None
        same = [r["accuracy"] for r in result.rows if r["lp_steps"] == steps and r["lp_epsilon_fraction"] is None]
        if same:
            ax.axhline(same[0], ls=":", color=line.get_color() if line else None,
                       label=f"lp_steps={steps}, one σ")
    ax.set(xlabel="share of ε spent linear probing (lp_epsilon_fraction)", ylabel="accuracy",
           title=f"LP→FT budget split, ε = {result.rows[0]['epsilon']:.2g} per run")
    ax.set_ylim(0, max(1e-3, float(np.nanmax([r["accuracy"] for r in result.rows])) * 1.1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    return csv_path, png_path
