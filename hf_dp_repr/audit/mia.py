"""Membership inference against a trained classifier: a loss-threshold attack and a difficulty-calibrated one.

- Loss attack (Yeom et al. 2018): score = −loss; members tend to have lower loss.
- Calibrated attack (Watson et al. 2022, "difficulty calibration"): score = −(loss under the target model − mean
  loss under reference models). The reference models are the user's: the same architecture trained the same way
  on data that contains none of the audited examples (e.g. on a public split); an example that every model finds
  hard is then no longer mistaken for a non-member. Without reference models only the loss attack is reported.

Metrics: ROC AUC, and the TPR at 1 % and 0.1 % FPR (Carlini et al. 2022: an attack matters by what it finds at
low FPR), from sklearn's `roc_curve`; `plot_roc` draws the ROC on log-log axes.

Example:
    >>> import numpy as np
    >>> m = roc_metrics(member_scores=np.array([3., 2., 1.5, 0.]), non_member_scores=np.array([1., 0.5, -1., -2.]))
    >>> m["auc"], m["tpr_at_1pct_fpr"]
    (0.875, 0.75)
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ArgumentError

MODEL_INPUTS = ("pixel_values", "input_ids", "attention_mask", "token_type_ids")


@torch.no_grad()
def classification_losses(model: torch.nn.Module, dataset, batch_size: int = 128) -> np.ndarray:
    """Cross-entropy of each example of `dataset` (columns among `MODEL_INPUTS` + `labels`) under `model`."""
    from tqdm.auto import tqdm

    model.eval()
    device = next(model.parameters()).device
    data = dataset.with_format("torch")
    inputs = [c for c in MODEL_INPUTS if c in data.column_names]
    out = []
    for start in tqdm(range(0, len(data), batch_size), desc="losses", leave=False, disable=len(data) <= 4 * batch_size):
        batch = data[start:start + batch_size]
        logits = model(**{c: batch[c].to(device) for c in inputs}).logits
        out.append(torch.nn.functional.cross_entropy(logits.double(), batch["labels"].to(device), reduction="none"))
    return torch.cat(out).cpu().numpy()


def calibrated_scores(target_losses: np.ndarray, reference_losses: list[np.ndarray]) -> np.ndarray:
    """−(target loss − mean reference loss): how much easier the example is for the target than for models that
    did not train on it."""
    if not reference_losses:
        raise ArgumentError("calibrated_scores: needs at least one reference model's losses")
    return -(np.asarray(target_losses) - np.mean(np.stack(reference_losses), axis=0))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """The highest TPR of a threshold whose FPR is ≤ `target` (0 if none)."""
    ok = fpr <= target
    return float(tpr[ok].max()) if ok.any() else 0.0


def roc_metrics(member_scores: np.ndarray, non_member_scores: np.ndarray) -> dict:
    """AUC, TPR at 1 % / 0.1 % FPR and the curve; a higher score means "member"."""
    from sklearn.metrics import roc_auc_score, roc_curve

    y = np.r_[np.ones(len(member_scores)), np.zeros(len(non_member_scores))]
    s = np.r_[member_scores, non_member_scores]
    fpr, tpr, _ = roc_curve(y, s)
    return {"auc": float(roc_auc_score(y, s)), "tpr_at_1pct_fpr": tpr_at_fpr(fpr, tpr, 0.01),
            "tpr_at_0.1pct_fpr": tpr_at_fpr(fpr, tpr, 0.001), "fpr": fpr.tolist(), "tpr": tpr.tolist()}


def plot_roc(curves: dict[str, dict], path: str, title: str = "Membership inference ROC") -> None:
    """Log-log ROC curves ({name: roc_metrics(...)}) with the chance diagonal, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    floor = 1e-4
    ax.plot([floor, 1], [floor, 1], "k--", lw=0.8, label="chance")
    for name, m in curves.items():
        ax.plot(np.clip(m["fpr"], floor, 1), np.clip(m["tpr"], floor, 1), label=f"{name} (AUC {m['auc']:.3f})")
    ax.set(xscale="log", yscale="log", xlim=(floor, 1), ylim=(floor, 1), xlabel="false positive rate",
           ylabel="true positive rate", title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
