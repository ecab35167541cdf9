"""The exposure audit as one run: the same data (private text + canaries) and the same schedule, trained without
DP (`transformers.Trainer`, the control) and with DP (`DPTrainer`), each canary's exposure measured under both.

What covers a canary inserted r times depends on the run's `privacy_unit`:
- `privacy_unit="row"`: each copy is a row, one unit; r copies are r units, covered only by group privacy:
  (r·ε, r·e^((r−1)ε)·δ) at most (`coverage`);
- `privacy_unit="document_id"`: the r copies share one `document_id` (each private row has its own), so a canary
  is one unit and ε covers it whole: this is the setting where the DP exposure should stay at the random level.

The non-private control is trained on the private rows outside DP-SGD: its exposures are NOT covered by any
guarantee (they go to the audit report, never to the model card or a push). The DP model's exposures are
post-processing of the DP model with canaries drawn from the run's secret, independent of the private data.

Example: see `tests/test_audit_exposure.py` (a tiny GPT-2 that learns a canary repeated 16 times).
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile

import numpy as np

from ..data import DOCUMENT_ID
from ..data.tokenizer import padded_rows, start_ids
from ..errors import DataError
from ..hub.card import EXPOSURE_FILE  # beside the DP model: its exposures only (the card renders them)
from .exposure import CANARY_FORMAT, RANDOM_LEVEL, Canary, exposures

REPORT_FILE, PLOT_FILE = "privacy_audit_exposure.json", "privacy_audit_exposure.png"  # never pushed (privacy_audit*)
WARNING = ("An empirical check of what the model remembers, not the guarantee: a small exposure does not prove "
           "privacy, and the guarantee is the ε of the ledger.")
NOT_COVERED = ("The non-private control was trained on the private rows outside DP-SGD: its exposures are not "
               "covered by any DP guarantee (this report is never pushed).")


def training_rows(texts: list[str], canaries: list[Canary], tokenizer, max_length: int, with_units: bool):
    """Each text and each copy of each inserted canary as one row of at most `max_length` tokens (BOS first, EOS last,
    right-padded, labels −100 on padding). `with_units`: a `document_id` column, one value per private row and
    one per canary (all its copies)."""
    items = [(t, f"row-{i}") for i, t in enumerate(texts)]
    items += [(c.text, f"canary-{c.name}") for c in canaries for _ in range(c.repeats)]
    too_long = [c.name for c in canaries if c.repeats and len(start_ids(tokenizer) + tokenizer(c.text)["input_ids"])
                >= max_length]
    if too_long:
        raise DataError(f"exposure audit: the canaries {too_long} do not fit in max_length={max_length} tokens; "
                        "raise max_length or shorten the secret.")
    # BOS first, as in the scoring: the canary sits at the positions where it is scored
    return padded_rows([t for t, _ in items], tokenizer, max_length,
                       {DOCUMENT_ID: [u for _, u in items]} if with_units else None)


def coverage(privacy_unit: str, repeats: int, epsilon: float | None, delta: float) -> str:
    """Which guarantee covers a canary inserted `repeats` times, in words."""
    if epsilon is None or not math.isfinite(epsilon):
        return "no DP guarantee (ε = ∞)"
    if privacy_unit == DOCUMENT_ID or repeats <= 1:
        return f"one unit: (ε = {epsilon:.3g}, δ = {delta:g})"
    group_delta = repeats * math.exp((repeats - 1) * epsilon) * delta
    return (f"{repeats} units (one per copy): group privacy only, (ε = {repeats * epsilon:.3g}, "
            f"δ = {min(1.0, group_delta):.3g})")


def exposure_audit(model, tokenizer, texts: list[str], dp_args, canaries: list[Canary], *, max_length: int = 64,
                   **exposure_kwargs) -> tuple[dict, object, object]:
    """Train a copy of `model` without DP and `model` with DP (`dp_args`: DPTrainingArguments, privacy_unit 'row'
    or 'document_id') on `texts` + the inserted canaries, for the same number of steps; measure every canary's
    exposure under both. Returns (report, the DP trainer, the non-private model)."""
    from transformers import Trainer, TrainingArguments

    from ..errors import RecipeArgumentError
    from ..training.trainer import DPTrainer

    if dp_args.privacy_unit not in ("row", DOCUMENT_ID):
        raise RecipeArgumentError(f"exposure audit: --privacy_unit {dp_args.privacy_unit}; use 'row' (each canary copy "
                                  f"a unit) or '{DOCUMENT_ID}' (each canary one unit).")
    data = training_rows(texts, canaries, tokenizer, max_length, dp_args.privacy_unit == DOCUMENT_ID)
    start = copy.deepcopy(model)
    dp = DPTrainer(model=model, args=dp_args, train_dataset=data, processing_class=tokenizer)
    dp.train()
    # the control trains what DP trained (trainable_blocks/groups): same scope, same schedule, no noise or clipping
    trained = {name: p.requires_grad for name, p in model.named_parameters()}
    for name, p in start.named_parameters():
        p.requires_grad_(trained[name])
    with tempfile.TemporaryDirectory(prefix="hf-dp-repr-exposure-") as tmp:
        plain_args = TrainingArguments(
            output_dir=tmp, max_steps=dp.state.global_step, learning_rate=dp_args.learning_rate,
            per_device_train_batch_size=dp_args.per_device_train_batch_size,
            gradient_accumulation_steps=dp_args.gradient_accumulation_steps, weight_decay=dp_args.weight_decay,
            lr_scheduler_type=dp_args.lr_scheduler_type, warmup_steps=dp_args.warmup_steps, seed=dp_args.seed,
            optim=dp_args.optim, use_cpu=dp_args.use_cpu, report_to="none", save_strategy="no", disable_tqdm=True)
        plain = Trainer(model=start, args=plain_args, train_dataset=data.remove_columns(
            [c for c in data.column_names if c == DOCUMENT_ID]))
        plain.train()
    eps = dp.ledger.epsilon()
    eps = eps if math.isfinite(eps) else None
    dp_rows, plain_rows = (exposures(m, tokenizer, canaries, **exposure_kwargs) for m in (dp.model, plain.model))
    report = {
        "claimed_epsilon": eps, "delta": dp_args.target_delta, "privacy_unit": dp_args.privacy_unit,
        "steps": dp.state.global_step, "training_rows": len(data), "private_rows": len(texts),
        "random_level": RANDOM_LEVEL,
        "canaries": [{**{k: v for k, v in d.items() if k not in ("rank", "log_perplexity")},
                      "exposure": d["exposure"], "non_private_exposure": p["exposure"],
                      "covered_by": coverage(dp_args.privacy_unit, d["repeats"], eps, dp_args.target_delta)}
                     for d, p in zip(dp_rows, plain_rows)],
        "warning": WARNING, "not_covered": NOT_COVERED,
    }
    return report, dp, plain.model


def by_repeats(report: dict, key: str) -> dict[int, float]:
    """Mean exposure per repetition count (0 = never inserted)."""
    out: dict[int, list[float]] = {}
    for c in report["canaries"]:
        out.setdefault(c["repeats"], []).append(c[key])
    return {r: float(np.mean(v)) for r, v in sorted(out.items())}


def save_exposure_report(report: dict, out_dir: str) -> list[str]:
    """Write the audit report (both models) and its plot to `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, REPORT_FILE), os.path.join(out_dir, PLOT_FILE)]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=2)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    eps = report["claimed_epsilon"]
    for key, label in (("non_private_exposure", "without DP"),
                       ("exposure", f"DP, ε = {eps:.3g}" if eps is not None else "DP, ε = ∞")):
        points = by_repeats(report, key)
        ax.plot([str(r) for r in points], list(points.values()), "o-", label=label)
    top = max(c["candidates"] for c in report["canaries"])
    ax.axhline(math.log2(top), color="grey", ls=":", label=f"log2 |R| = {math.log2(top):.1f}")
    ax.axhline(RANDOM_LEVEL, color="k", ls="--", lw=0.8, label="random (never seen)")
    ax.set(xlabel="times inserted (0 = never)", ylabel="exposure (bits)", title="Canary exposure")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def save_model_exposures(report: dict, model_dir: str) -> str:
    """Write the DP model's exposures (not the control's) beside it as `canary_exposure.json` and refresh its card,
    which then reports them with the warning that they are an empirical check, not the guarantee."""
    from ..hub.card import refresh_model_card

    rows = [{k: c[k] for k in ("name", "repeats", "candidates", "method", "exposure", "covered_by")}
            for c in report["canaries"]]
    path = os.path.join(model_dir, EXPOSURE_FILE)
    with open(path, "w") as f:
        json.dump({"canaries": rows, "random_level": RANDOM_LEVEL, "privacy_unit": report["privacy_unit"],
                   "claimed_epsilon": report["claimed_epsilon"], "warning": WARNING,
                   "format": CANARY_FORMAT.format(name="NAME", secret="…")}, f, indent=2)
    refresh_model_card(model_dir)
    return path
