"""The geometric law across layers: value_l ≈ ρ^l · value_0, fitted as a line in log space.

`fit_law(values, layers)` regresses log(value_l) on the layer index l by least squares and reports
ρ = exp(slope), the intercept (the fitted log value at l = 0) and Pearson's r of (l, log value_l).
Index l is the index into the model's `hidden_states`: 0 is the embedding output, l ≥ 1 the output of block l.

Defaults used by the analyzers (and by `fuzziness_law` / `residual_law` below):
  - separation fuzziness includes the embedding output: D_l ≈ ρ^l · D_0 (He & Su 2023), layers 0..L;
  - prediction residual excludes it: PR_l ≈ ρ^(l−1) · PR_1 (He & Su 2024), layers 1..L.
    The slope is the same either way; only the intercept's reference layer differs (PR_1 = exp(intercept)·ρ).

Example:
    >>> from hf_dp_repr.analysis import fit_law
    >>> fit = fit_law([8.0, 4.0, 2.0, 1.0])
    >>> round(fit.rho, 6), round(fit.r, 6), fit.layers
    (0.5, -1.0, (0, 1, 2, 3))
    >>> round(fit.predict(4), 6)
    0.5
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ArgumentError, DataError

__all__ = ["LawFit", "fit_law", "fuzziness_law", "residual_law"]


@dataclass(frozen=True)
class LawFit:
    """Least-squares fit log(value_l) = intercept + l·log(rho) over `layers`.

    Attributes:
        rho: per-layer decay factor exp(slope); < 1 when the value shrinks with depth.
        intercept: fitted log(value) at layer 0.
        r: Pearson correlation of (layer, log value); NaN when all values are equal.
        layers: the layer indices the fit used.
    """

    rho: float
    intercept: float
    r: float
    layers: tuple[int, ...]

    @property
    def slope(self) -> float:
        return math.log(self.rho)

    def predict(self, layer: float) -> float:
        """Fitted value at `layer`: exp(intercept) · rho**layer."""
        return math.exp(self.intercept + self.slope * layer)

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}


def fit_law(values: Sequence[float] | Mapping[int, float], layers: Sequence[int] | None = None) -> LawFit:
    """Fit value_l ≈ ρ^l · exp(intercept) by least squares of log(value_l) on l.

    Args:
        values: per-layer values; a sequence is indexed by layer (values[0] = embedding output), a mapping
            maps layer index → value.
        layers: the layer indices to fit (default: all given). Use e.g. `range(1, L + 1)` for the residual law.

    Raises ValueError when fewer than 2 layers are selected or a selected value is not positive and finite.

    Example:
        >>> fit = fit_law([3.0, 1.0, 0.5, 0.25], layers=[1, 2, 3])   # skip layer 0
        >>> round(fit.rho, 6), fit.layers
        (0.5, (1, 2, 3))
    """
    table = dict(values) if isinstance(values, Mapping) else dict(enumerate(values))
    chosen = sorted(table) if layers is None else [int(layer) for layer in layers]
    missing = [layer for layer in chosen if layer not in table]
    if missing:
        raise ArgumentError(f"`layers` {missing} have no entry in `values` (layers available: {sorted(table)})")
    if len(set(chosen)) < 2:
        raise ArgumentError(f"fitting the law needs at least 2 distinct layers, got {chosen}; pass more `values`")
    y = np.array([table[layer] for layer in chosen], dtype=np.float64)
    bad = [layer for layer, v in zip(chosen, y) if not (np.isfinite(v) and v > 0)]
    if bad:
        raise DataError(f"the law is fitted in log space, so values must be positive and finite; layers {bad} "
                        f"are not ({[table[b] for b in bad]}); leave them out with `layers=`")
    x = np.array(chosen, dtype=np.float64)
    logy = np.log(y)
    slope, intercept = np.polyfit(x, logy, 1)
    r = float(np.corrcoef(x, logy)[0, 1]) if np.ptp(logy) > 0 else float("nan")
    return LawFit(rho=float(np.exp(slope)), intercept=float(intercept), r=r, layers=tuple(chosen))


def _fit_usable(values: Sequence[float], first: int, name: str) -> LawFit | None:
    layers = list(range(first, len(values)))
    usable = [layer for layer in layers if np.isfinite(values[layer]) and values[layer] > 0]
    if len(usable) < len(layers):
        skipped = sorted(set(layers) - set(usable))
        warnings.warn(f"{name} law: layers {skipped} have non-positive or undefined values and are left out of "
                      f"the fit (e.g. a perfect fit with more dims than examples, or a constant feature)")
    return fit_law(values, usable) if len(usable) >= 2 else None


def fuzziness_law(fuzziness: Sequence[float]) -> LawFit | None:
    """D_l ≈ ρ^l · D_0 over layers 0..L (embedding output included); None if < 2 layers are usable."""
    return _fit_usable(fuzziness, 0, "fuzziness")


def residual_law(residual: Sequence[float]) -> LawFit | None:
    """PR_l ≈ ρ^(l−1) · PR_1 over layers 1..L (embedding output excluded); None if < 2 layers are usable."""
    return _fit_usable(residual, 1, "residual")
