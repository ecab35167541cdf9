"""Separation fuzziness D = Tr(SS_w · SS_b⁺) of one layer's features (He & Su, PNAS 2023).

For features x of K classes with n_k examples each (n in all), class means x̄_k and overall mean x̄:

    SS_b = (1/n) Σ_k n_k (x̄_k − x̄)(x̄_k − x̄)ᵀ            (between-class, rank ≤ K − 1)
    SS_w = (1/n) Σ_k Σ_i (x_ki − x̄_k)(x_ki − x̄_k)ᵀ       (within-class)
    D    = Tr(SS_w · SS_b⁺)

Smaller D means better separated classes. Seed paper 000 prints the formula inverted, as Tr(SS_b · SS_w⁺),
and centres SS_w on the wrong mean; we follow He & Su, whose code computes `trace(within @ pinv(between))`.

Numerics: everything is float64. SS_b⁺ is built from the SVD of the K × d matrix M whose rows are
sqrt(n_k / n)(x̄_k − x̄) (so SS_b = MᵀM), truncated to rank K − 1: with M = U Σ Vᵀ,
D = Σ_j v_jᵀ SS_w v_j / σ_j². Directions with σ_j below σ_max · max(K, d) · eps are dropped too (numpy's
pinv rule), with eps the machine epsilon of the features' dtype: float32 features confined to fewer than
K − 1 dims would otherwise turn their rounding noise into huge terms. A float32 `pinv` of the d × d SS_b is
dominated by rounding noise in its d − K + 1 null directions, which is why it is not used.

Example:
    >>> import numpy as np
    >>> from hf_dp_repr.analysis import separation_fuzziness
    >>> x = np.array([[0.0, 1.0], [0.0, -1.0], [4.0, 1.0], [4.0, -1.0]])
    >>> round(separation_fuzziness(x, [0, 0, 1, 1]), 6)   # SS_w = diag(0, 1), SS_b = diag(4, 0)
    0.0
    >>> x[:, 1] = [0.5, -0.5, 0.5, -0.5]; x[:, 0] += [1, -1, 1, -1]    # within-class spread along the means
    >>> round(separation_fuzziness(x, [0, 0, 1, 1]), 6)   # SS_w[0, 0] = 1, SS_b[0, 0] = 4
    0.25
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DataError
from ._checks import as_float64_matrix, as_int_labels, input_eps

__all__ = ["SeparationStats", "separation_fuzziness"]


class SeparationStats:
    """Streaming sufficient statistics for D: per-class counts and means, and the pooled within-class scatter.

    Memory is O(K·d + d²) whatever the number of examples. Batches are merged with Chan et al.'s update
    (centre each batch on its own class means, then add the rank-one corrections), so a large common offset
    in the features does not cancel catastrophically as it would with raw second moments.

    Example:
        >>> import torch
        >>> stats = SeparationStats()
        >>> x, y = torch.randn(100, 5), torch.arange(100) % 3
        >>> for i in range(0, 100, 32):
        ...     _ = stats.update(x[i:i + 32], y[i:i + 32])
        >>> abs(stats.fuzziness() - separation_fuzziness(x, y)) < 1e-9
        True
    """

    def __init__(self) -> None:
        self.num_examples = 0
        self._index: dict[int, int] = {}  # class id -> row of counts/means
        self.counts: torch.Tensor | None = None  # (K,) float64
        self.means: torch.Tensor | None = None  # (K, d) float64
        self.within: torch.Tensor | None = None  # (d, d) float64, Σ_k Σ_i (x − x̄_k)(x − x̄_k)ᵀ
        self.input_eps = float(torch.finfo(torch.float64).eps)  # coarsest precision of the features seen

    @property
    def num_classes(self) -> int:
        return len(self._index)

    def update(self, features: Any, labels: Any) -> "SeparationStats":
        """Add a batch: `features` (m × d) and integer `labels` (m,). Returns self."""
        x = as_float64_matrix(features, "features")
        y = as_int_labels(labels, x.shape[0], "labels", device=x.device)
        self.input_eps = max(self.input_eps, input_eps(features))
        if self.within is None:
            d = x.shape[1]
            self.counts = x.new_zeros(0)
            self.means = x.new_zeros(0, d)
            self.within = x.new_zeros(d, d)
        elif x.shape[1] != self.within.shape[0]:
            raise DataError(f"`features` has {x.shape[1]} dims but earlier batches had {self.within.shape[0]}")
        x = x.to(self.within.device)
        y = y.to(self.within.device)

        classes, inverse, batch_counts = torch.unique(y, return_inverse=True, return_counts=True)
        batch_counts = batch_counts.to(torch.float64)
        batch_means = x.new_zeros(len(classes), x.shape[1]).index_add_(0, inverse, x) / batch_counts[:, None]
        centred = x - batch_means[inverse]
        self.within += centred.T @ centred

        rows = self._rows_for(classes.tolist())
        old_counts = self.counts[rows]
        total = old_counts + batch_counts
        delta = batch_means - self.means[rows]
        # Chan's merge: the scatter of two groups adds n_a·n_b/(n_a+n_b)·δδᵀ on top of each group's own.
        self.within += (delta * (old_counts * batch_counts / total)[:, None]).T @ delta
        self.means[rows] += delta * (batch_counts / total)[:, None]
        self.counts[rows] = total
        self.num_examples += x.shape[0]
        return self

    def _rows_for(self, classes: list[int]) -> torch.Tensor:
        new = [c for c in classes if c not in self._index]
        if new:
            for c in new:
                self._index[c] = len(self._index)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(len(new))])
            self.means = torch.cat([self.means, self.means.new_zeros(len(new), self.means.shape[1])])
        return torch.tensor([self._index[c] for c in classes], device=self.within.device)

    def scatter_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(SS_w, SS_b) as float64 d × d tensors (for inspection and tests; D itself never forms SS_b⁺)."""
        self._require_two_classes()
        weighted = self._weighted_centred_means()
        return self.within / self.num_examples, weighted.T @ weighted

    def fuzziness(self) -> float:
        """D = Tr(SS_w · SS_b⁺), SS_b⁺ at rank K − 1. NaN when the class means coincide (SS_b = 0)."""
        self._require_two_classes()
        weighted = self._weighted_centred_means()
        _, sing, vh = torch.linalg.svd(weighted, full_matrices=False)
        rank = self.num_classes - 1
        # Also drop directions that are zero up to rounding at the features' own precision (pinv's rule):
        # e.g. equal class means, or means confined to fewer than K − 1 dims but for float32 rounding.
        tol = sing[0] * max(weighted.shape) * self.input_eps
        keep = sing[:rank] > tol
        if not bool(keep.any()):
            return float("nan")
        v = vh[:rank][keep]
        ss_w = self.within / self.num_examples
        quad = ((v @ ss_w) * v).sum(dim=1)  # v_jᵀ SS_w v_j
        return float((quad / sing[:rank][keep] ** 2).sum())

    def _weighted_centred_means(self) -> torch.Tensor:
        weights = self.counts / self.num_examples
        grand_mean = weights @ self.means
        return weights.sqrt()[:, None] * (self.means - grand_mean)

    def _require_two_classes(self) -> None:
        if self.num_classes < 2:
            raise DataError(
                f"separation fuzziness needs at least 2 classes in `labels`, got {self.num_classes}; "
                "analyse a set that contains several classes"
            )


def separation_fuzziness(features: Any, labels: Any) -> float:
    """D = Tr(SS_w · SS_b⁺) for one layer's `features` (n × d array or tensor) and integer `labels` (n,).

    Computed in float64; SS_b⁺ is taken at rank K − 1 from the SVD of the weighted, centred class means (see
    the module docstring). Invariant to translating, scaling and rotating the features. Smaller is better
    separated. Raises ValueError for fewer than 2 classes, mismatched lengths, non-finite features, and when
    the class means all coincide (D undefined).

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> y = np.repeat([0, 1, 2], 200)
        >>> tight = np.eye(3)[y] * 10 + rng.normal(size=(600, 3))
        >>> loose = np.eye(3)[y] * 1 + rng.normal(size=(600, 3))
        >>> separation_fuzziness(tight, y) < separation_fuzziness(loose, y)
        True
    """
    value = SeparationStats().update(features, labels).fuzziness()
    if value != value:  # NaN
        raise DataError("all class means of `features` coincide (SS_b = 0), so D is undefined; "
                        "check that `labels` match `features` and that the features are not constant")
    return value
