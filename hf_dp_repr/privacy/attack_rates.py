"""What a DP guarantee means for an attacker: the largest true-positive rate (TPR) any membership test can reach at
a given false-positive rate (FPR), and the largest advantage TPR − FPR, computed from the run's own privacy profile.

A test sees the released model and guesses whether one example (one unit) was in the training set, for the
neighbouring relation the guarantee states (replace-one: the dataset had this example or another one in its place;
add/remove: the dataset had it or not). Differential privacy bounds every such test at once: its trade-off curve
(Dong, Roth & Su 2019, f-DP) is computed here from the privacy loss distribution of the DP-SGD history (σ, q,
steps per phase; dp_accounting's PLD with pessimistic rounding, so each bound is an upper bound) by riskcal
(Kulynych et al. 2024, Algorithm 1). Unlike the (ε, δ) pair alone, this uses the whole curve: at FPR 1 % a test on
a run with ε = 8 can reach far less than the e^ε·FPR + δ the pair alone allows.

For one Gaussian mechanism of sensitivity 1 (σ, q = 1, one step, add/remove) the bound is the closed form
TPR = Φ(Φ⁻¹(FPR) + 1/σ); k such steps compose to Φ(Φ⁻¹(FPR) + √k/σ); replace-one doubles the sensitivity.

Imports neither torch nor transformers (`hf-dp-repr privacy` stays light).

Example:
    >>> rates = attack_rates([(1.0, 1.0, 1)], "add_remove")
    >>> round(rates.tpr_at_fpr[0.01], 4), round(rates.advantage, 4)
    (0.0924, 0.3829)
    >>> for part in rates.describe().split("; "):
    ...     print(part)
    a membership test can reach at most TPR 1.83 % at FPR 0.1 %, 9.24 % at 1 %, 38.9 % at 10 %
    advantage (TPR − FPR) at most 38.3 %
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..errors import DPConfigError

ATTACK_FPRS = (0.001, 0.01, 0.1)  # the false-positive rates reported
# dp_accounting's privacy-loss grid (also `accountants.PLD_DISCRETIZATION`): its pessimistic rounding raises every loss
# to the grid, so a coarser grid only raises the bounds.
PLD_DISCRETIZATION = 1e-3
PLD_GRID_POINTS = 200_000  # at most this many grid points across one step's privacy losses (`pld_discretization`)
# Finer where one step's losses are far below PLD_DISCRETIZATION (scale ~ q/σ: a small q and a large σ): there each
# step's rounding up adds a whole grid interval to tiny losses, and over 1e5 steps the 1e-3 grid reported ε ≈ 3-20×
# the finer grid's (q = 1e-4, σ = 47). A quarter of q/σ stays within ~0.5 % of a 100× finer grid.
PLD_STEP_FRACTION = 4
PLD_FINEST = 1e-9  # (a finer grid would only be slower; a coarser one is still an upper bound)


def pld_discretization(history) -> float:
    """dp_accounting's privacy-loss grid for a history [(σ, q, steps), ...]: PLD_DISCRETIZATION; finer where one
    step's losses are much smaller than it (a quarter of the smallest q/σ, their scale: `PLD_STEP_FRACTION`); coarser
    when σ is so small that one step's losses spread over thousands (mean (Δ/σ)²/2 with Δ ≤ 2, ± 10 standard
    deviations Δ/σ): at σ = 0.01 the 1e-3 grid had millions of points and took minutes. Pessimistic rounding raises
    every loss to the grid, so any grid gives an upper bound of ε and of the TPR bounds; a finer one a tighter bound.

    Example:
        >>> pld_discretization([(1.0, 0.01, 1000)]), round(pld_discretization([(0.01, 0.5, 2)]), 2)
        (0.001, 0.11)
        >>> pld_discretization([(40.0, 1e-4, 100_000)])  # losses of ~q/σ = 2.5e-6 per step
        6.25e-07
    """
    phases = [(float(sigma), float(q)) for sigma, q, _ in history if float(sigma) > 0 and float(q) > 0]
    if not phases:
        return PLD_DISCRETIZATION
    fine = min(q / sigma for sigma, q in phases) / PLD_STEP_FRACTION
    return max(PLD_FINEST, min(PLD_DISCRETIZATION, fine), max(_loss_width(s, q) for s, q in phases) / PLD_GRID_POINTS)


def _loss_width(sigma: float, q: float) -> float:
    """How far one step's privacy losses spread: the Gaussian's L up to (Δ/σ)²/2 + 10 Δ/σ (Δ = 2), subsampled at q:
    log(1 − q + q·e^L) (= L at q = 1), in log space so that a tiny σ does not overflow."""
    top = 2 / sigma**2 + 20 / sigma
    return top if q >= 1 else float(np.logaddexp(math.log1p(-q), math.log(q) + top))


@dataclass(frozen=True)
class AttackRates:
    """Upper bounds on what a membership test can reach: TPR at each FPR of `ATTACK_FPRS`, and max TPR − FPR."""

    tpr_at_fpr: dict[float, float]
    advantage: float
    neighboring: str
    source: str = "privacy loss distribution"  # or "(ε, δ)" when only the pair is known (a private search)

    def describe(self) -> str:
        rates = ", ".join(f"{_percent(tpr)} at {_percent(fpr)}" if i else f"TPR {_percent(tpr)} at FPR {_percent(fpr)}"
                          for i, (fpr, tpr) in enumerate(self.tpr_at_fpr.items()))
        return (f"a membership test can reach at most {rates}; advantage (TPR − FPR) at most "
                f"{_percent(self.advantage)}")

    def to_dict(self) -> dict:
        return {"neighboring": self.neighboring, "source": self.source, "advantage": self.advantage,
                "tpr_at_fpr": {f"{fpr:g}": tpr for fpr, tpr in self.tpr_at_fpr.items()}}


def _percent(p: float) -> str:
    return f"{100 * p:.3g} %" if p < 1 else "100 %"


def gaussian_pld(history, neighboring: str, pessimistic: bool = True):
    """dp_accounting's privacy loss distribution of DP-SGD's history [(σ, q, steps), ...] (Poisson-subsampled
    Gaussian steps, composed), for "add_remove" or "replace_one" neighbours. `pessimistic`: every loss rounded up
    (an upper bound of the true curve); False: rounded down (a lower bound, `accountants._lower_bound`)."""
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as pld

    relation = dp_accounting.NeighboringRelation
    total, grid = None, pld_discretization(history)  # one grid for every phase: their PLDs compose
    for sigma, q, steps in history:
        step = pld.from_gaussian_mechanism(
            sigma, pessimistic_estimate=pessimistic, value_discretization_interval=grid,
            sampling_prob=q, use_connect_dots=pessimistic,  # connect-the-dots has no optimistic rounding
            neighboring_relation=relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE)
        step = step.self_compose(int(steps))
        total = step if total is None else total.compose(step)
    return total


def attack_rates(history, neighboring: str) -> AttackRates:
    """The bounds for a DP-SGD history [(σ, q, steps), ...] (every σ > 0; σ = 0 or no step: 1 and 0)."""
    history = tuple((float(s), float(q), int(t)) for s, q, t in history if int(t) > 0)
    return _attack_rates(history, neighboring)


@functools.lru_cache(maxsize=32)
def _attack_rates(history: tuple, neighboring: str) -> AttackRates:
    if not history:  # nothing released that saw the data
        return AttackRates(dict(zip(ATTACK_FPRS, ATTACK_FPRS)), 0.0, neighboring)
    if any(sigma <= 0 for sigma, _, _ in history):  # no noise: a test can be perfect
        return AttackRates({fpr: 1.0 for fpr in ATTACK_FPRS}, 1.0, neighboring)
    from riskcal.analysis import get_advantage_from_pld, get_beta_from_pld

    pld = gaussian_pld(history, neighboring)
    fnr = np.atleast_1d(get_beta_from_pld(pld, alpha=np.array(ATTACK_FPRS)))
    tpr = {fpr: _clip(1.0 - float(b), fpr) for fpr, b in zip(ATTACK_FPRS, fnr)}
    return AttackRates(tpr, _clip(float(get_advantage_from_pld(pld)), 0.0), neighboring)


def tpr_at_fpr(history, fpr: float, neighboring: str) -> float:
    """The largest TPR any membership test reaches at FPR `fpr` against a DP-SGD history [(σ, q, steps), ...] (every
    σ > 0), from its privacy loss distribution as in `attack_rates`."""
    return _tpr_at_fpr(tuple((float(s), float(q), int(t)) for s, q, t in history if int(t) > 0), float(fpr),
                       neighboring)


@functools.lru_cache(maxsize=256)  # a calibration asks again for the σ it bisects between
def _tpr_at_fpr(history: tuple, fpr: float, neighboring: str) -> float:
    if not history:
        return fpr
    if any(sigma <= 0 for sigma, _, _ in history):
        return 1.0
    from riskcal.analysis import get_beta_from_pld

    beta = np.atleast_1d(get_beta_from_pld(gaussian_pld(history, neighboring), alpha=np.array([fpr])))[0]
    return _clip(1.0 - float(beta), fpr)


@dataclass(frozen=True)
class AttackTarget:
    """A privacy target stated for the attacker: no membership test reaches a TPR above `tpr` at FPR `fpr`
    (`DPTrainingArguments.target_attack_tpr_at_fpr`, written "TPR@FPR": "0.05@0.01" is TPR 5 % at FPR 1 %).

    Example:
        >>> AttackTarget.parse("0.05@0.01").describe()
        'a membership test can reach at most TPR 5 % at FPR 1 %'
    """

    tpr: float
    fpr: float

    @classmethod
    def parse(cls, text, name: str = "target_attack_tpr_at_fpr") -> "AttackTarget":
        """The target written `text` ("TPR@FPR", fractions); a `DPConfigError` naming `name` if it is not one."""
        parts = text.split("@") if isinstance(text, str) else ()
        try:
            tpr, fpr = (float(p) for p in parts)
        except ValueError:
            raise DPConfigError(f"{name}={text!r} is not a target 'TPR@FPR' (two fractions, e.g. '0.05@0.01': no "
                                "membership test reaches a true-positive rate above 5 % at a false-positive rate "
                                "of 1 %).") from None
        if not 0 < fpr < 1:
            raise DPConfigError(f"{name}={text!r}: the false-positive rate {fpr:g} must be in (0, 1), e.g. 0.01.")
        if not fpr < tpr < 1:
            raise DPConfigError(f"{name}={text!r}: the true-positive rate {tpr:g} must be in (FPR, 1) = ({fpr:g}, 1): "
                                "a test reaches TPR = FPR by guessing, so no noise gives a lower TPR, and TPR 1 "
                                "limits nothing.")
        return cls(tpr, fpr)

    def __str__(self) -> str:
        return f"{self.tpr:g}@{self.fpr:g}"

    def describe(self) -> str:
        return f"a membership test can reach at most TPR {_percent(self.tpr)} at FPR {_percent(self.fpr)}"


def attack_rates_from_epsilon(epsilon: float, delta: float, neighboring: str) -> AttackRates:
    """The bounds an (ε, δ) pair alone gives (looser than a profile's): TPR ≤ min(e^ε·FPR + δ,
    1 − e^−ε·(1 − δ − FPR)), advantage ≤ (e^ε − 1 + 2δ) / (e^ε + 1). For a guarantee known only as a pair, e.g. a
    private hyperparameter search's."""
    if not math.isfinite(epsilon):
        return AttackRates({fpr: 1.0 for fpr in ATTACK_FPRS}, 1.0, neighboring, "(ε, δ)")
    e = math.exp(epsilon)
    tpr = {fpr: _clip(min(e * fpr + delta, 1 - (1 - delta - fpr) / e), fpr) for fpr in ATTACK_FPRS}
    return AttackRates(tpr, _clip((e - 1 + 2 * delta) / (e + 1), 0.0), neighboring, "(ε, δ)")


def _clip(p: float, low: float) -> float:
    """Into [low, 1]: no test does worse than guessing at its FPR, and float error can pass 1."""
    return min(1.0, max(low, p))
