"""Canary audit in one training run (Steinke, Nasr & Jagielski 2023): an empirical lower bound on ε.

1. `make_canaries`: m examples the model could only fit by memorising them: real images with a wrong label
   ("mislabelled") or uniform-noise images with a random label ("ood"), taken from data that is not in training.
2. `draw_inclusion`: each canary goes into the training set with probability 1/2. The draw is the audit's
   secret: it comes from the OS (`secrets`), never from `TrainingArguments.seed` or anything saved beside the
   model (whoever knew it could not be "guessing"). `seed=` exists for reproducible tests and is NOT secret.
3. Train once (DPTrainer, or `transformers.Trainer` as the non-private control) on the data plus the included
   canaries; score every canary by its loss under the trained model.
4. `guess`: the k canaries of lowest loss are guessed "in", the k of highest loss "out", the rest abstained on;
   `bounds.one_run_epsilon_lower_bound` turns (m, r = 2k, v correct) into ε_lb at confidence 1 − β.
   k is fixed before looking at the scores: choosing it after seeing which k gives the largest bound would be a
   multiple test that the bound does not cover.

The bound is a statement about the training algorithm as run: if ε_lb exceeds the ε the ledger claims, the
implementation (or the accounting) is broken. The losses are computed on canaries only, but the trained model saw
private data: see `hf_dp_repr.audit` on what the report may be used for.

Example (the scoring half, on a model trained elsewhere):
    >>> import numpy as np
    >>> losses = np.array([0.1, 0.2, 3.0, 2.5, 0.15, 4.0]); included = np.array([1, 1, 0, 0, 1, 0], bool)
    >>> g = guess(losses, k=2); g.tolist()
    [1, 0, -1, 0, 1, -1]
    >>> score_guesses(g, included)
    (4, 4)
"""

from __future__ import annotations

import secrets

import numpy as np
from datasets import Dataset, concatenate_datasets

from ..errors import ArgumentError, DPConfigError

CANARY_KINDS = ("mislabelled", "ood")


def draw_inclusion(m: int, seed: int | None = None) -> np.ndarray:
    """A boolean vector: canary i is trained on iff True, each independently with probability 1/2.

    `seed=None` (default): a 128-bit secret from the OS, held only in memory. An explicit `seed` makes the draw
    reproducible for tests; it is then not secret, and an audit whose auditor could know it proves nothing.
    """
    key = secrets.randbits(128) if seed is None else int(seed)
    return np.random.default_rng(key).random(m) < 0.5


def make_canaries(source: Dataset, m: int, kind: str = "mislabelled", num_labels: int | None = None,
                  seed: int | None = None) -> Dataset:
    """m canaries with `source`'s columns (`pixel_values`, `labels`), from rows of `source` that must not be in
    the training set (e.g. the test split). "mislabelled": the first m rows of a random permutation, each with a
    label drawn uniformly among the wrong ones; "ood": uniform noise images in [-1, 1] with uniform labels.
    Which canaries exist is public (only which ones were trained on is secret): `seed` may be public."""
    if kind not in CANARY_KINDS:
        raise ArgumentError(f"make_canaries: kind must be one of {CANARY_KINDS}, got {kind!r}")
    if m <= 0 or m > len(source):
        raise ArgumentError(f"make_canaries: m must be in 1..{len(source)} (rows of source), got {m}")
    num_labels = num_labels or source.features["labels"].num_classes
    rng = np.random.default_rng(seed)
    rows = source.select(rng.permutation(len(source))[:m].tolist()).with_format("numpy")
    pixels = np.asarray(rows["pixel_values"], dtype=np.float32)
    labels = np.asarray(rows["labels"], dtype=np.int64)
    if kind == "mislabelled":
        labels = (labels + rng.integers(1, num_labels, size=m)) % num_labels  # never the true label
    else:
        pixels = rng.uniform(-1, 1, size=pixels.shape).astype(np.float32)
        labels = rng.integers(0, num_labels, size=m)
    return Dataset.from_dict({"pixel_values": pixels, "labels": labels},
                             features=source.features).with_format("torch")


def with_canaries(train: Dataset, canaries: Dataset, included: np.ndarray) -> Dataset:
    """The training set: `train` plus the canaries whose `included` entry is True (appended; batches are
    sampled at random, so the position tells nothing)."""
    if len(included) != len(canaries):
        raise ArgumentError(f"with_canaries: {len(included)} inclusion draws for {len(canaries)} canaries")
    chosen = canaries.select(np.flatnonzero(included).tolist())
    return concatenate_datasets([train.with_format(None), chosen.with_format(None)]).with_format("torch")


def guess(losses: np.ndarray, k: int) -> np.ndarray:
    """+1 ("in") for the k lowest losses, −1 ("out") for the k highest, 0 (abstain) for the rest."""
    m = len(losses)
    if not 0 < 2 * k <= m:
        raise ArgumentError(f"guess: need 0 < 2k <= m canaries, got k={k}, m={m}")
    order = np.argsort(losses, kind="stable")
    guesses = np.zeros(m, dtype=np.int64)
    guesses[order[:k]] = 1
    guesses[order[m - k:]] = -1
    return guesses


def score_guesses(guesses: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """(r guesses made, v correct)."""
    truth = np.where(included, 1, -1)
    made = guesses != 0
    return int(made.sum()), int((guesses[made] == truth[made]).sum())


def one_run_audit(losses: np.ndarray, included: np.ndarray, k: int, delta: float, beta: float = 0.05) -> dict:
    """Guess on the canaries from their losses and bound ε: {m, k, guesses, correct, epsilon_lower_bound, ...}."""
    from .bounds import one_run_epsilon_lower_bound
    from .mia import roc_metrics

    losses, included = np.asarray(losses), np.asarray(included, bool)
    g = guess(losses, k)
    r, v = score_guesses(g, included)
    m = len(losses)
    auc = roc_metrics(-losses[included], -losses[~included])["auc"] if 0 < included.sum() < m else None
    return {"canaries": m, "included": int(np.sum(included)), "k": k, "guesses": r, "correct": v,
            "delta": delta, "confidence": 1 - beta, "canary_auc": auc,
            "epsilon_lower_bound": one_run_epsilon_lower_bound(m, r, v, delta, beta)}


def check_add_remove(args, caller: str) -> None:
    """Refuse a run whose ε is stated for another relation: a canary is added to or left out of the training set."""
    if args.neighboring != "add_remove":
        raise DPConfigError(f"{caller}: each canary is added to or left out of the training set, so the audit tests an "
                            f"add/remove guarantee; this run claims ε for neighboring={args.neighboring!r}. Audit a "
                            "run with neighboring='add_remove'.")


def train_with_canaries(model, args, train: Dataset, canaries: Dataset, *, k: int, beta: float = 0.05,
                        delta: float | None = None, inclusion_seed: int | None = None) -> dict:
    """Draw the inclusions, train `model` once on `train` + included canaries, audit; returns the audit dict with
    `claimed_epsilon` (from the ledger; None = ∞ for noise_multiplier=0 and for the plain Trainer) and the trainer as
    `trainer_obj`. The canaries must not be private examples: only then are the audit's numbers post-processing of
    the trained model that the DP guarantee covers (see `save_canary_audit`).

    `args` a `DPTrainingArguments` trains with `DPTrainer` (δ = its target_delta); a plain `TrainingArguments`
    trains with `transformers.Trainer`, the non-private control (give `delta` to state the δ to test against).
    """
    from transformers import Trainer

    from ..training.arguments import DPTrainingArguments
    from ..training.trainer import DPTrainer
    from .mia import classification_losses

    private = isinstance(args, DPTrainingArguments)
    if private:
        check_add_remove(args, "train_with_canaries")
    included = draw_inclusion(len(canaries), inclusion_seed)
    data = with_canaries(train, canaries, included)
    trainer = (DPTrainer if private else Trainer)(model=model, args=args, train_dataset=data)
    trainer.train()
    delta = trainer.ledger.plan.target_delta if private else (1e-5 if delta is None else delta)  # the plan's δ
    result = one_run_audit(classification_losses(trainer.model, canaries), included, k, delta, beta)
    claimed = trainer.ledger.epsilon() if private else float("inf")
    result.update(claimed_epsilon=claimed if np.isfinite(claimed) else None, training_examples=len(data),
                  trainer="DPTrainer" if private else "transformers.Trainer (non-private control)",
                  noise_multiplier=(trainer.ledger.plan.phases[-1].noise_multiplier if private else None),
                  trainer_obj=trainer)
    return result


def save_canary_audit(result: dict, output_dir: str) -> str:
    """Opt in to showing the one-run bound in the DP model card: write `output_dir/canary_audit.json` (which the
    card renders beside the claimed ε and pushes upload) and refresh the card. The numbers are post-processing of
    the DP-trained model with the public canaries and the inclusion draw, which owes nothing to the private data;
    the draw itself is not written."""
    import json
    import os

    from ..hub.card import CANARY_AUDIT_FILE, refresh_model_card

    keys = ("canaries", "included", "k", "guesses", "correct", "delta", "confidence", "epsilon_lower_bound",
            "claimed_epsilon", "trainer")
    path = os.path.join(output_dir, CANARY_AUDIT_FILE)
    with open(path, "w") as f:
        json.dump({k: result[k] for k in keys if k in result}, f, indent=2)
    refresh_model_card(output_dir)
    return path
