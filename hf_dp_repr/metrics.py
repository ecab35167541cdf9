"""Metrics a user passes to `DPTrainer(compute_metrics=...)`, computed locally: nothing to download, nothing to log
beyond the returned numbers (they are computed on the evaluation set, which the trainer checks is not the
training set).

    >>> import numpy as np
    >>> from transformers import EvalPrediction
    >>> from hf_dp_repr import accuracy_metrics
    >>> compute_metrics = accuracy_metrics()
    >>> compute_metrics(EvalPrediction(predictions=np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]]),
    ...                                label_ids=np.array([0, 1, 0])))
    {'accuracy': 0.6666666666666666}
"""

from __future__ import annotations


def accuracy_metrics():
    """`compute_metrics` for a classifier's Trainer: {"accuracy": the fraction of examples whose largest logit is
    their label} (the same number as `evaluate.load("accuracy")`, without fetching it from the Hub)."""
    import numpy as np

    def compute_metrics(pred) -> dict[str, float]:
        logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
        predictions = np.argmax(logits, axis=-1)
        return {"accuracy": float((predictions == np.asarray(pred.label_ids)).mean())}

    return compute_metrics
