"""Prediction residual PR of one layer's features (He & Su 2024, "A law of next-token prediction").

Fit y ≈ w·x + b by least squares (with intercept) and report

    PR = Σ (y − ŷ)² / Σ (y − ȳ)²        (= 1 − R²; 0 is a perfect fit, 1 explains nothing)

Targets: the class label for vision, a scalar as in seed 000 ([CLS] → label). For language, the next token as a
class: its one-hot indicator over the vocabulary (`next_token_codes`), not its id (a scalar fit to ids of an
arbitrary ordering of tens of thousands of tokens measures the ordering: PR_l ≈ 0.5 at every layer of SmolLM2).
Pass 2-D targets (n × q) for a multi-output fit, or `one_hot=True` to regress on one-hot class indicators; PR is
then Σ_j RSS_j / Σ_j TSS_j over the q outputs.

Numerics: float64 throughout. Only the centred cross-products of [x, y] are kept (merged batch by batch with
Chan et al.'s update), so memory is O((d + q)²). The normal equations are solved on the correlation scale
(features divided by their standard deviations), dropping eigen-directions below d·eps64 of the largest,
or whose spread is at the rounding level of the features' dtype: exactly collinear features (LayerNorm
outputs lie in a hyperplane) and constant ones count once, as in a rank-revealing least-squares solve. PR is
therefore unchanged by any invertible affine map of the features.

Example:
    >>> import numpy as np
    >>> from hf_dp_repr.analysis import prediction_residual
    >>> x = np.array([[0.0], [1.0], [2.0], [3.0]])
    >>> round(prediction_residual(x, [1.0, 3.0, 5.0, 7.0]), 12)    # y = 2x + 1 exactly
    0.0
    >>> round(prediction_residual(x, [0.0, 1.0, 1.0, 0.0]), 12)    # a line explains none of it
    1.0
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DataError
from ._checks import as_float64_matrix, as_float64_targets, as_int_labels, input_eps

__all__ = ["ResidualStats", "next_token_codes", "prediction_residual"]

NEXT_TOKEN_WIDTH = 256  # columns of the next-token target: the one-hot itself up to this vocabulary size, else a sketch
SKETCH_SEED = 0  # one fixed sketch: every model compared is measured against the same target


def next_token_codes(vocab_size: int, width: int = NEXT_TOKEN_WIDTH) -> torch.Tensor:
    """The target rows of the next-token residual, one per token id: (vocab_size × q), float64.

    Up to `width` tokens, the identity (one-hot targets: PR = Σ_j RSS_j / Σ_j TSS_j over the vocabulary). Above,
    a fixed random ±1/√width projection of the one-hot (q = width): its RSS and TSS are each the one-hot's in
    expectation over the draw, and with many distinct next tokens their ratio stays within about a percent of the
    one-hot PR, which for a 49k vocabulary would need a (d + 49k)² scatter. The seed is fixed, so the draw is
    public and the same for every model compared.

    Example:
        >>> next_token_codes(4).tolist() == torch.eye(4, dtype=torch.float64).tolist()
        True
        >>> codes = next_token_codes(50_000); codes.shape, bool((codes.abs() == 1 / 16).all())
        (torch.Size([50000, 256]), True)
    """
    if vocab_size <= width:
        return torch.eye(vocab_size, dtype=torch.float64)
    draw = torch.Generator().manual_seed(SKETCH_SEED)
    signs = torch.randint(0, 2, (vocab_size, width), generator=draw, dtype=torch.int8)
    return (2.0 * signs.to(torch.float64) - 1.0) / width**0.5


class ResidualStats:
    """Streaming sufficient statistics for PR: count, mean and centred scatter of the joint vector [x, y].

    Example:
        >>> import torch
        >>> stats = ResidualStats()
        >>> x = torch.randn(200, 4); y = x @ torch.tensor([1.0, 0.0, -2.0, 0.5]) + 0.1 * torch.randn(200)
        >>> for i in range(0, 200, 64):
        ...     _ = stats.update(x[i:i + 64], y[i:i + 64])
        >>> abs(stats.residual() - prediction_residual(x, y)) < 1e-9
        True
    """

    def __init__(self, num_classes: int | None = None, class_codes: torch.Tensor | None = None) -> None:
        """`num_classes`: regress on one-hot indicators of that many classes (targets are then class ids).
        `class_codes` (classes × q): regress on row `class_codes[id]` of each target id (`next_token_codes`)."""
        if class_codes is not None:
            num_classes = class_codes.shape[0]
        self.num_classes = num_classes
        self.class_codes = class_codes
        self.num_examples = 0
        self.mean: torch.Tensor | None = None  # (d + q,)
        self.scatter: torch.Tensor | None = None  # (d + q, d + q), Σ (z − z̄)(z − z̄)ᵀ
        self.dim: int | None = None
        self.input_eps = float(torch.finfo(torch.float64).eps)  # coarsest precision of the features seen

    def update(self, features: Any, targets: Any) -> "ResidualStats":
        """Add a batch: `features` (m × d) and `targets` (m,) or (m × q). Returns self."""
        x = as_float64_matrix(features, "features")
        self.input_eps = max(self.input_eps, input_eps(features))
        if self.num_classes is not None:
            labels = as_int_labels(targets, x.shape[0], "targets", device=x.device)
            if bool(((labels < 0) | (labels >= self.num_classes)).any()):
                raise DataError(f"`targets` must be class ids in [0, {self.num_classes}) for one-hot regression")
            if self.class_codes is None:
                y = torch.nn.functional.one_hot(labels, self.num_classes).to(torch.float64)
            else:
                y = self.class_codes.to(x.device)[labels]
        else:
            y = as_float64_targets(targets, x.shape[0], "targets", device=x.device)
        z = torch.cat([x, y], dim=1)
        if self.scatter is None:
            self.dim = x.shape[1]
            self.mean = z.new_zeros(z.shape[1])
            self.scatter = z.new_zeros(z.shape[1], z.shape[1])
        elif z.shape[1] != self.scatter.shape[0]:
            raise DataError(f"`features`/`targets` have {x.shape[1]}/{y.shape[1]} columns but earlier batches "
                            f"had {self.dim}/{self.scatter.shape[0] - self.dim}")
        z = z.to(self.scatter.device)

        m, n = z.shape[0], self.num_examples
        batch_mean = z.mean(dim=0)
        centred = z - batch_mean
        delta = batch_mean - self.mean
        # Chan's merge of two groups' centred scatters: no raw second moments, so no cancellation.
        self.scatter += centred.T @ centred + torch.outer(delta, delta) * (n * m / (n + m))
        self.mean += delta * (m / (n + m))
        self.num_examples = n + m
        return self

    def residual(self) -> float:
        """PR = RSS / TSS of the least-squares fit with intercept; NaN when the targets are constant."""
        if self.scatter is None:
            raise DataError("no data: call `update(features, targets)` at least once")
        d = self.dim
        sxx, sxy = self.scatter[:d, :d], self.scatter[:d, d:]
        tss = torch.diagonal(self.scatter[d:, d:]).sum()
        if float(tss) <= 0.0:
            return float("nan")
        # Correlation scale: makes the rank cut-off independent of each feature's units.
        eps = torch.finfo(torch.float64).eps
        std = torch.diagonal(sxx).sqrt()
        # Constant columns only carry the rounding of their centring (~ eps·|mean|·sqrt(n)): leave them to
        # the intercept instead of blowing that noise up to unit variance.
        noise_floor = 64 * eps * self.num_examples**0.5 * self.mean[:d].abs()
        varying = (std > noise_floor) & (std > std.max() * eps * d)
        if not bool(varying.any()):
            return 1.0  # constant features: the intercept alone predicts ȳ
        s = std[varying]
        corr = sxx[varying][:, varying] / torch.outer(s, s)
        proj = sxy[varying] / s[:, None]
        evals, evecs = torch.linalg.eigh(corr)
        # Eigenvalues are variances: besides eigh's own error (d·eps64), drop directions whose spread is at
        # the rounding level of the features' dtype ((d·eps_in)² in variance), e.g. float32 LayerNorm outputs.
        keep = evals > evals[-1] * max(corr.shape[0] * eps, (corr.shape[0] * self.input_eps) ** 2)
        coef = evecs[:, keep].T @ proj  # (r, q)
        explained = ((coef**2) / evals[keep][:, None]).sum()
        return float(((tss - explained) / tss).clamp(min=0.0))


def prediction_residual(features: Any, targets: Any, *, one_hot: bool = False) -> float:
    """PR = Σ(y − ŷ)² / Σ(y − ȳ)² of the least-squares fit with intercept from `features` (n × d) to `targets`.

    `targets`: (n,) scalars (a class label) or (n × q) for a multi-output fit. With
    `one_hot=True`, `targets` are integer class ids regressed as one-hot indicators (q = number of distinct
    classes), PR = Σ_j RSS_j / Σ_j TSS_j. Float64; unchanged by any invertible affine map of the features.
    Raises ValueError on mismatched lengths, non-finite values, or constant targets.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(500, 3))
        >>> y = x @ [1.0, -1.0, 0.0] + rng.normal(size=500)     # signal variance 2, noise variance 1
        >>> abs(prediction_residual(x, y) - 1 / 3) < 0.05
        True
        >>> labels = (x[:, 0] > 0).astype(int) + 2 * (x[:, 1] > 0)
        >>> 0 < prediction_residual(x, labels, one_hot=True) < 1
        True
    """
    if one_hot:
        x = as_float64_matrix(features, "features")
        labels = as_int_labels(targets, x.shape[0], "targets", device=x.device)
        _, targets = torch.unique(labels, return_inverse=True)  # dense ids 0..q−1
        stats = ResidualStats(num_classes=int(targets.max()) + 1).update(x, targets)
    else:
        stats = ResidualStats().update(features, targets)
    value = stats.residual()
    if value != value:
        raise DataError("`targets` are constant, so PR = RSS / TSS is 0/0; pass varying targets")
    return value
