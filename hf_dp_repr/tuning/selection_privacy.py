"""The privacy cost of a hyperparameter search on private data: Papernot & Steinke, "Hyperparameter tuning with
Rényi differential privacy" (ICLR 2022).

Run a base mechanism Q (here: pick hyperparameters at random, train with DP-SGD, score the model) K times, with K
drawn at random (from secret randomness) from a known distribution, and release only the best run. If every run
of Q is (λ, ε(λ))-RDP, the search A is (λ, ε'(λ))-RDP with:

- K ~ truncated negative binomial D(η, γ), η > -1, 0 < γ < 1 (Theorem 2; η = 1: geometric, η = 0: logarithmic):
      ε'(λ) = ε(λ) + (1 + η)(1 - 1/λ̂) ε(λ̂) + (1 + η) log(1/γ) / λ̂ + log(E[K]) / (λ - 1)  (any λ̂ ≥ 1),
      E[K] = η (1 - γ) / (γ (1 - γ^η))   (η ≠ 0),   (1/γ - 1) / log(1/γ)   (η = 0);
  λ̂ is chosen to minimise the bound (over the same grid of orders).
- K ~ Poisson(μ) (Theorem 6; K = 0 releases nothing): if Q is (ε̂, δ̂)-DP with ε̂ = log(1 + 1/(λ - 1)),
      ε'(λ) = ε(λ) + μ δ̂ + log(μ) / (λ - 1).

ε(λ) of a DP-SGD run is the RDP curve of its schedule (a sum over its phases): Opacus' for add/remove neighbours;
for replace-one neighbours, the Rényi divergence of the pair dp_accounting's PLD uses for a Poisson-sampled Gaussian
step, ((1-q)N(0, σ²) + qN(-1, σ²), (1-q)N(0, σ²) + qN(1, σ²)), integrated numerically. Trials with different batch
sizes or lengths have different curves: Q is then a data-independent mixture of them, and the Rényi divergence of
a mixture is at most the largest of its parts (quasi-convexity), so the pointwise maximum over every schedule the
search space can draw bounds ε(λ). ε'(λ) is converted to (ε, δ)-DP as Opacus does (Balle et al. 2020).

Example (a Gaussian mechanism, ε(λ) = λ / (2σ²) with σ = 3, searched with a geometric number of trials, E[K] = 4):
    >>> import numpy as np
    >>> from hf_dp_repr.tuning.selection_privacy import TrialCount, ORDERS, search_epsilon
    >>> curve = ORDERS / (2 * 3.0 ** 2)
    >>> count = TrialCount.geometric(gamma=0.25)
    >>> count.expected()
    4.0
    >>> round(search_epsilon(curve, count, delta=1e-5), 2)
    2.49
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from ..errors import ArgumentError

# RDP orders λ (and λ̂): fine near 1, where small ε lives, up to 512 for large ε.
ORDERS = np.array([1 + x / 20 for x in range(1, 100)] + list(range(6, 64)) + [64, 80, 96, 128, 192, 256, 512],
                  dtype=float)


def rdp_curve(history, orders=ORDERS, neighboring: str = "add_remove") -> np.ndarray:
    """ε(λ) at each order of a DP-SGD schedule [(σ, q, steps), ...]: Opacus' RDP analysis for add/remove
    neighbours, `replace_one_rdp` for replace-one neighbours."""
    if neighboring not in ("add_remove", "replace_one"):
        raise ArgumentError(f"rdp_curve: unknown neighbouring relation {neighboring!r}.")
    total = np.zeros(len(orders))
    for sigma, q, steps in history:
        if sigma == 0:
            return np.full(len(orders), np.inf)
        if neighboring == "replace_one":
            total += int(steps) * replace_one_rdp(sigma, q, orders)
        else:
            total += np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=int(steps), orders=list(orders)))
    return total


def replace_one_rdp(sigma: float, q: float, orders=ORDERS) -> np.ndarray:
    """D_λ(P ‖ Q) at each order λ for one step with replace-one neighbours, P = (1-q)N(0, σ²) + qN(-1, σ²) and
    Q = (1-q)N(0, σ²) + qN(1, σ²) (symmetric, so D_λ(Q ‖ P) is the same). The integrand P^λ Q^(1-λ) has its bulk
    near [-1, 1] and, for large λ, a peak between x = -λ (q < 1: P/Q grows like e^(-x/σ²)) and x = 1 - 2λ (q = 1):
    the grid covers [1 - 2λ, 1] and 16 σ beyond, in steps of σ/40 (a Riemann sum of a smooth bell: tested against
    the closed form at q = 1 and against dp_accounting's ε)."""
    from scipy.special import logsumexp

    out = []
    for lam in np.asarray(orders, dtype=float):
        x, step = np.linspace(-2 * lam - 16 * sigma - 2, 16 * sigma + 2, retstep=True,
                              num=int((2 * lam + 32 * sigma + 4) / (sigma / 40)) + 1)
        def log_mix(shift):
            shifted = -((x + shift) ** 2) / (2 * sigma**2)
            return shifted if q >= 1 else np.logaddexp(math.log1p(-q) - x**2 / (2 * sigma**2), math.log(q) + shifted)
        log_integrand = lam * log_mix(1.0) + (1 - lam) * log_mix(-1.0) - 0.5 * math.log(2 * math.pi * sigma**2)
        out.append((logsumexp(log_integrand) + math.log(step)) / (lam - 1))
    return np.array(out)


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K: "truncated_negative_binomial" (η, γ) or "poisson" (μ)."""

    kind: str
    eta: float = 1.0
    gamma: float = 0.5
    mu: float = 1.0

    def __post_init__(self):
        if self.kind == "truncated_negative_binomial":
            if not (0 < self.gamma < 1 and self.eta >= 0):
                raise ArgumentError("trial count: truncated negative binomial needs 0 < gamma < 1 and eta >= 0 (eta "
                                    f"in (-1, 0) is valid in the paper but not sampled here); got eta={self.eta}, "
                                    f"gamma={self.gamma}.")
        elif self.kind == "poisson":
            if not self.mu > 0:
                raise ArgumentError(f"trial count: poisson needs mu > 0, got {self.mu}.")
        else:
            raise ArgumentError(f"trial count: unknown distribution {self.kind!r}; use 'truncated_negative_binomial' "
                                "(TrialCount.geometric, .logarithmic, .negative_binomial) or 'poisson'.")

    @classmethod
    def geometric(cls, gamma: float) -> "TrialCount":
        """P[K = k] = γ (1 - γ)^(k-1), k ≥ 1: E[K] = 1/γ."""
        return cls("truncated_negative_binomial", eta=1.0, gamma=gamma)

    @classmethod
    def logarithmic(cls, gamma: float) -> "TrialCount":
        return cls("truncated_negative_binomial", eta=0.0, gamma=gamma)

    @classmethod
    def negative_binomial(cls, eta: float, gamma: float) -> "TrialCount":
        return cls("truncated_negative_binomial", eta=eta, gamma=gamma)

    @classmethod
    def poisson(cls, mu: float) -> "TrialCount":
        return cls("poisson", mu=mu)

    def expected(self) -> float:
        if self.kind == "poisson":
            return self.mu
        eta, gamma = self.eta, self.gamma
        if eta == 0:
            return (1 / gamma - 1) / math.log(1 / gamma)
        return eta * (1 - gamma) / (gamma * (1 - gamma ** eta))

    def sample(self, rng: np.random.Generator | None = None) -> int:
        """A draw of K. Default: from a fresh OS-entropy secret (the analysis needs K secret and random; never
        seed it from the public `args.seed`)."""
        rng = rng or np.random.default_rng(secrets.randbits(128))
        if self.kind == "poisson":
            return int(rng.poisson(self.mu))
        if self.eta == 0:
            return int(rng.logseries(1 - self.gamma))
        while True:  # the negative binomial conditioned on K ≥ 1
            k = int(rng.negative_binomial(self.eta, self.gamma))
            if k >= 1:
                return k

    def describe(self) -> str:
        if self.kind == "poisson":
            return f"Poisson(μ={self.mu:g})"
        name = {1.0: "geometric", 0.0: "logarithmic"}.get(float(self.eta), "truncated negative binomial")
        return f"{name}(η={self.eta:g}, γ={self.gamma:g}), E[K]={self.expected():.3g}"


def delta_at(curve, epsilon: float, orders=ORDERS) -> float:
    """δ such that a mechanism with RDP curve `curve` is (ε, δ)-DP (the inverse of Opacus' conversion)."""
    orders = np.asarray(orders, dtype=float)
    with np.errstate(invalid="ignore", over="ignore"):
        log_delta = (orders - 1) * (np.asarray(curve) - epsilon + np.log1p(-1 / orders)) - np.log(orders)
    return float(min(1.0, np.exp(np.nanmin(log_delta))))


def selection_rdp(curve, count: TrialCount, orders=ORDERS, orders_hat=None) -> np.ndarray:
    """ε'(λ) of the search at each order λ in `orders`, for the base curve ε(λ) at `orders` (Papernot–Steinke)."""
    orders = np.asarray(orders, dtype=float)
    curve = np.asarray(curve, dtype=float)
    log_ek = math.log(count.expected())
    if count.kind == "poisson":
        hat = ORDERS if orders_hat is None else np.asarray(orders_hat, dtype=float)
        hat_curve = curve if orders_hat is None else np.interp(hat, orders, curve)
        deltas = np.array([delta_at(hat_curve, math.log1p(1 / (lam - 1)), hat) for lam in orders])
        return curve + count.mu * deltas + log_ek / (orders - 1)
    eta, gamma = count.eta, count.gamma
    if orders_hat is None:
        hat, hat_curve = orders, curve
    else:
        hat = np.asarray(orders_hat, dtype=float)
        hat_curve = np.array([curve[np.argmin(np.abs(orders - h))] for h in hat])
        if not all(np.isclose(orders[np.argmin(np.abs(orders - h))], h) for h in hat):
            raise ArgumentError("selection_rdp: orders_hat must be among the orders the curve is given at.")
    penalty = np.min((1 + eta) * (1 - 1 / hat) * hat_curve + (1 + eta) * math.log(1 / gamma) / hat)
    return curve + penalty + log_ek / (orders - 1)


def search_epsilon(curve, count: TrialCount, delta: float, orders=ORDERS) -> float:
    """ε at `delta` of the whole search (best of K runs, each with RDP curve `curve` at `orders`)."""
    rdp = selection_rdp(curve, count, orders)
    if not np.isfinite(rdp).any():
        return math.inf
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns when the best order is at the edge of the grid
        eps, _ = get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps)


def single_run_epsilon(curve, delta: float, orders=ORDERS) -> float:
    """ε at `delta` of one run with RDP curve `curve` (for comparison with the search's total)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_privacy_spent(orders=list(orders), rdp=list(curve), delta=delta)[0])
