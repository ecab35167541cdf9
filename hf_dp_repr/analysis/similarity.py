"""How far a layer's features moved: linear CKA between two models' features of the same examples (Kornblith et
al. 2019), per layer. 1: the same up to rotation and scale; near 0: unrelated. What seeds 001/003 call feature
distortion, measured against the public model's features.

Example:
    >>> import numpy as np
    >>> from hf_dp_repr.analysis import linear_cka
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(200, 8))
    >>> q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    >>> round(linear_cka(x, 3 * x @ q), 6), linear_cka(x, rng.normal(size=(200, 8))) < 0.2
    (1.0, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DataError
from .features import extract_features

__all__ = ["layer_cka", "linear_cka"]


def linear_cka(x: Any, y: Any) -> float:
    """Linear CKA of two feature matrices with the same rows (n × d₁, n × d₂): ‖Yᵀ X‖²_F / (‖Xᵀ X‖_F ‖Yᵀ Y‖_F)
    on column-centred features, in [0, 1]."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 2 or len(x) != len(y):
        raise DataError(f"linear_cka needs two n × d matrices with the same rows; got {x.shape} and {y.shape}")
    x = x - x.mean(0)
    y = y - y.mean(0)
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    if denom == 0:
        raise DataError("linear_cka: a feature matrix is constant (no variance to compare)")
    return float(np.linalg.norm(y.T @ x) ** 2 / denom)


def layer_cka(model: Any, reference: Any, dataset: Any, num_layers: int, **extract_kwargs) -> list[float]:
    """Linear CKA of `model`'s and `reference`'s features at every hidden state 0..num_layers-1 on `dataset`
    (read as `extract_features` reads it: [CLS] or mean pooling; keyword arguments go there)."""
    return [linear_cka(extract_features(model, dataset, layer=layer, progress=False, **extract_kwargs)[0],
                       extract_features(reference, dataset, layer=layer, progress=False, **extract_kwargs)[0])
            for layer in range(num_layers)]
