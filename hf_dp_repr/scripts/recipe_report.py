"""What a recipe shows while and after it runs: ε logged at a sensible cadence, progress lines during public
pre-training, and a short result table at the end (main process only)."""

from __future__ import annotations

import logging
import math
import time

from transformers import TrainerCallback

logger = logging.getLogger("hf_dp_repr.recipes")
LOG_LINES = 20  # default: about this many log lines (loss, ε) per run


def plan_notes(data_notes, defaults=None) -> list[str]:
    """The lines a recipe's logged plan ends with (`DPTrainer.plan_notes`): how its data was read (`data: ...`: a
    label set read off the rows, an evaluation split held out), then the DP-aware defaults chosen and why."""
    return [f"data: {note}" for note in data_notes] + ([defaults.describe()] if defaults is not None else [])


def default_logging(training_args, planned_steps: int, given: set[str]) -> None:
    """Unless --logging_steps / --logging_strategy were given, log (loss, ε) about `LOG_LINES` times per run instead
    of every 500 steps (the Trainer's default, more than a short DP run has)."""
    if given & {"logging_steps", "logging_strategy"}:
        return
    training_args.logging_steps = max(1, planned_steps // LOG_LINES)


class ProgressLines(TrainerCallback):
    """One log line every `every` epochs (and at the end) of a plain Trainer run: epoch, loss, seconds."""

    def __init__(self, what: str, epochs: float, log=logger.info, lines: int = 8):
        self.what, self.log = what, log
        self.every = max(1, math.ceil(epochs / lines))
        self.start = time.time()
        self.last_loss = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.last_loss = logs["loss"]

    def on_epoch_end(self, args, state, control, **kwargs):
        epoch = round(state.epoch or 0)
        if state.is_world_process_zero and (epoch % self.every == 0 or epoch >= args.num_train_epochs):
            loss = f", loss {self.last_loss:.3f}" if self.last_loss is not None else ""
            self.log(f"{self.what}: epoch {epoch}/{args.num_train_epochs:g}{loss} ({time.time() - self.start:.0f} s)")


def result_table(metrics: dict, ledger, eval_split: str, extra: dict | None = None,
                 public_fraction: float = 0.0) -> str:
    """A short Markdown table: the held-out metrics, ε spent / target, δ, DP steps and σ, the examples trained on with
    DP (from the run's `PrivacyLedger` and its plan) and, when `public_fraction` of the training split was used as
    public data, that it was trained on without DP."""
    rows, plan = [], ledger.plan
    if "eval_accuracy" in metrics:
        rows.append((f"{eval_split} accuracy", f"{100 * metrics['eval_accuracy']:.1f} %"))
    if "eval_perplexity" in metrics:
        rows.append((f"{eval_split} perplexity", f"{metrics['eval_perplexity']:.2f}"))
    if "eval_loss" in metrics:
        rows.append((f"{eval_split} loss", f"{metrics['eval_loss']:.4f}"))
    eps = metrics.get("epsilon")
    eps_text = (f"∞ (noise_multiplier=0{', no clipping' if plan.clipping == 'none' else ''}: NOT private)"
                if eps is None or math.isinf(eps) else f"{eps:.4f}")
    if plan.target_epsilon is not None:
        eps_text += f" (target {plan.target_epsilon:g})"
    if plan.target_attack_tpr_at_fpr is not None:
        eps_text += f" (σ calibrated for target_attack_tpr_at_fpr={plan.target_attack_tpr_at_fpr})"
    rows.append(("ε spent", eps_text))
    rows.append(("δ", f"{plan.target_delta:g}"))
    sigmas = ", ".join(f"{p.noise_multiplier:.3f}" for p in plan.phases)
    rows.append(("DP steps", f"{ledger.steps_done} of {plan.planned_steps} (σ = {sigmas}, "
                             f"q = {plan.phases[-1].sample_rate:.4f}, accountant {plan.accountant})"))
    unit = plan.privacy_unit
    part = f" (the {1 - public_fraction:.0%} of the training split not used as public data)" if public_fraction else ""
    rows.append(("examples trained with DP", f"{plan.dataset_size}{part}") if unit == "row" else
                ("units trained with DP", f"{plan.dataset_size} (a unit: all rows sharing a {unit}){part}"))
    if public_fraction:
        rows.append(("public data, no DP", f"{public_fraction:.0%} of the training split, trained on WITHOUT DP "
                                           "(--public_fraction)"))
    rows += list((extra or {}).items())
    width = max(len(k) for k, _ in rows)
    return "\n".join(["| result | value |", "|---|---|"]
                     + [f"| {k:<{width}} | {str(v).replace('|', '/').replace(chr(10), ' ')} |" for k, v in rows])
