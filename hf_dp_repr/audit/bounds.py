"""Empirical lower bounds on ε: the one-run canary bound and the classic multi-run Clopper–Pearson bound.

One run (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run", Thm. 5.2 and App. D):
m canaries, each included in training independently with probability 1/2; the auditor guesses "in" or "out" on
r of them (abstains on the rest) and gets v right. If training is (ε, δ)-DP (add/remove one canary), then with
q = e^ε / (1 + e^ε) (the accuracy of ε-randomised response) and f(u) = P[Binomial(r, q) ≥ u],

    P[v or more right] ≤ p(ε) = f(v) + 2 m δ · max_{i = 1..v} (f(v − i) − f(v)) / i.

p(ε) grows with ε; the lower bound at confidence 1 − β is the largest ε with p(ε) ≤ β: every smaller ε is
rejected at level β. With δ = 0 the second term vanishes.

What a one-run audit can certify at most (`one_run_ceiling`), before training: an included canary that is never
sampled (Poisson rate q over T steps: with probability (1 − q)^T) leaves no trace, so even a run with noise and
clipping switched off lets a perfect guesser tell apart only the included canaries that were sampled. With m/2 of
them included and each seen with probability s, the expected right guesses of the best guesser (k "in" guesses on
the canaries seen, then on the unseen; k "out" guesses on the unseen, which are excluded with probability
1/(2 − s)) give the bound above; below the run's claimed ε the audit cannot tell a broken run from a correct one.

Multi-run: a threshold attack on one canary over N runs with it and N without gives TPR and FPR. Any (ε, δ)-DP
training satisfies TPR ≤ e^ε FPR + δ and (1 − FPR) ≤ e^ε (1 − TPR) + δ, so with one-sided Clopper–Pearson
bounds (TPR_lo, FPR_hi, each at level β/2, jointly 1 − β)

    ε ≥ max(log((TPR_lo − δ) / FPR_hi), log((1 − FPR_hi − δ) / (1 − TPR_lo))).

Example:
    >>> round(one_run_epsilon_lower_bound(m=1000, r=100, v=100, delta=0.0, beta=0.05), 3)   # all 100 right
    3.493
    >>> one_run_epsilon_lower_bound(m=1000, r=100, v=50, delta=1e-5, beta=0.05)             # chance level
    0.0
    >>> one_run_ceiling(m=1000, k=50, seen=1.0, delta=0.0) == one_run_epsilon_lower_bound(1000, 100, 100, 0.0)
    True
    >>> round(one_run_ceiling(m=100, k=25, seen=0.35, delta=1e-5), 3)   # each sampled 0.43 times on average
    0.394
    >>> lo, hi = clopper_pearson(45, 50, alpha=0.05); round(lo, 4), round(hi, 4)
    (0.8012, 0.9598)
"""

from __future__ import annotations

import math

from scipy import optimize, stats

from ..errors import ArgumentError, ArgumentTypeError


def _check_counts(m: int, r: int, v: int) -> None:
    if not (isinstance(m, int) and isinstance(r, int) and isinstance(v, int)):
        raise ArgumentTypeError(f"m, r, v must be integers, got {m!r}, {r!r}, {v!r}")
    if not 0 <= v <= r <= m:
        raise ArgumentError(f"need 0 <= v (correct) <= r (guesses) <= m (canaries), got v={v}, r={r}, m={m}")


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """p(ε): an upper bound on P[≥ v of r guesses right] for an (ε, δ)-DP training run (module docstring)."""
    _check_counts(m, r, v)
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ArgumentError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-randomised response
    tail = stats.binom.sf(v - 1, r, q)  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return float(min(tail, 1.0))
    below = 0.0  # f(v - i) - f(v) = P[v - i <= Binomial(r, q) < v]
    worst = 0.0
    for i in range(1, v + 1):
        below += stats.binom.pmf(v - i, r, q)
        worst = max(worst, below / i)
    return float(min(tail + 2 * m * delta * worst, 1.0))


def one_run_epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest ε that m canaries, r guesses and v correct ones reject at confidence 1 − `beta` (0 if none).

    It is a lower bound on the ε of the training run with probability ≥ 1 − beta over the canary draws.
    """
    _check_counts(m, r, v)
    if not 0 < beta < 1:
        raise ArgumentError(f"beta (1 - confidence) must be in (0, 1), got {beta}")
    if one_run_p_value(m, r, v, 0.0, delta) > beta:
        return 0.0  # not even ε = 0 is rejected
    hi = 1.0
    while one_run_p_value(m, r, v, hi, delta) <= beta:
        hi *= 2
        if hi > 1e3:  # p(ε) stays below β for every ε (e.g. δ = 0 and v = r large): no finite bound needed
            return math.inf
    return float(optimize.brentq(lambda e: one_run_p_value(m, r, v, e, delta) - beta, 0.0, hi, xtol=1e-9))


def one_run_ceiling(m: int, k: int, seen: float, delta: float, beta: float = 0.05) -> float:
    """The bound `one_run_epsilon_lower_bound` gives on the expected right guesses of a perfect guesser when each
    included canary is sampled at least once with probability `seen` (module docstring): the most the audit of m
    canaries and 2k guesses can certify, whatever the run."""
    _check_counts(m, 2 * k, 0)
    if not 0 <= seen <= 1:
        raise ArgumentError(f"seen (the probability that an included canary is sampled) must be in [0, 1], got {seen}")
    detected = m / 2 * seen
    unseen_included = (1 - seen) / (2 - seen)  # share of included canaries among those that left no trace
    right = min(k, detected) + max(k - detected, 0) * unseen_included + k / (2 - seen)
    return one_run_epsilon_lower_bound(m, 2 * k, min(2 * k, round(right)), delta, beta)


def clopper_pearson(successes: int, trials: int, alpha: float = 0.05) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds (lower, upper) on a binomial proportion, each holding with prob. 1 − alpha.

    lower = Beta(alpha; k, n − k + 1) quantile (0 when k = 0), upper = Beta(1 − alpha; k + 1, n − k) quantile
    (1 when k = n).
    """
    if not (0 <= successes <= trials and trials > 0):
        raise ArgumentError(f"need 0 <= successes <= trials and trials > 0, got {successes}/{trials}")
    k, n = successes, trials
    lower = 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))
    upper = 1.0 if k == n else float(stats.beta.ppf(1 - alpha, k + 1, n - k))
    return lower, upper


def multi_run_epsilon_lower_bound(true_positives: int, positives: int, false_positives: int, negatives: int,
                                  delta: float, beta: float = 0.05) -> dict:
    """ε lower bound at confidence 1 − beta from TP of `positives` runs with the canary and FP of `negatives`
    without it (one-sided Clopper–Pearson at beta/2 each). Returns the bound and the intervals it used."""
    tpr_lo, tpr_hi = clopper_pearson(true_positives, positives, beta / 2)
    fpr_lo, fpr_hi = clopper_pearson(false_positives, negatives, beta / 2)
    candidates = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        candidates.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1 - fpr_hi - delta > 0 and 1 - tpr_lo > 0:
        candidates.append(math.log((1 - fpr_hi - delta) / (1 - tpr_lo)))
    return {"epsilon_lower_bound": max(candidates), "tpr": true_positives / positives,
            "fpr": false_positives / negatives, "tpr_lower": tpr_lo, "fpr_upper": fpr_hi, "confidence": 1 - beta,
            "delta": delta}
