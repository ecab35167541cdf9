"""Privacy accounting: σ calibration and ε of a history (the plan and the ledger of a run: `ledger.py`).

Every ε reported by this library comes from `compute_epsilon`, i.e. from a real accountant run on the history of
(σ, sample rate, steps) that was actually executed: dp_accounting's `pld` (privacy loss distributions, the default
and the only one here that also does replace-one neighbours) or Opacus' `prv` or `rdp`. Opacus' `gdp` is refused:
its central-limit approximation is not an upper bound and under-reports ε for DP-SGD. A target ε below what an
accountant can certify at all (its floor, `epsilon_floor`) is refused with the numbers (`too_low_message`).

The neighbouring relation says what ε protects: `replace_one` (datasets of the same size n that differ in one
example: the relation that holds when n is published, as the ledger and the model card do, and DPTrainer's default)
or `add_remove` (Opacus' setting: one example added or removed, so n itself, and the sample rate, steps and epochs
that reveal it, must stay secret; ε is smaller).

Example:
    >>> from hf_dp_repr.privacy.accounting import calibrate_noise_multiplier, compute_epsilon, epsilon_floor
    >>> sigma = calibrate_noise_multiplier(target_epsilon=8.0, target_delta=1e-5, sample_rate=0.01, steps=1000)
    >>> eps = compute_epsilon([(sigma, 0.01, 1000)], delta=1e-5)  # Opacus' PRV accountant, add/remove neighbours
    >>> 7.99 <= eps <= 8.0
    True
    >>> round(epsilon_floor(delta=1e-5, sample_rate=0.01, steps=1000, accountant="prv"), 5)  # PRV's resolution
    0.00999
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import numpy as np
from opacus.accountants import create_accountant
from opacus.accountants.utils import MAX_SIGMA

from .._moved import moved_attribute
from ..errors import OutOfReachError
from ..quiet import RDP_LARGEST_ALPHA

# Calibrated σ spends between (1 - tolerance)·ε and ε: tight enough that "exactly the target" holds to 0.1 %.
RELATIVE_EPSILON_TOLERANCE = 1e-3
# dp_accounting's privacy-loss grid for `pld`. Its pessimistic estimate rounds every loss up to the grid, so a coarser
# grid only raises ε: 1e-3 reports at most ~0.1 % above dp_accounting's finer default (1e-4) and calibrates 5-10×
# faster (measured on histories of 3 to 1000 steps; tests/test_accounting.py checks it is never below).
PLD_DISCRETIZATION = 1e-3
ACCOUNTANTS = ("prv", "rdp", "pld")
NEIGHBORING_RELATIONS = ("add_remove", "replace_one")
GDP_REFUSED = ("the 'gdp' accountant is refused: its central-limit approximation is not an upper bound and "
               "under-reports ε for DP-SGD (e.g. 0.47 for a true 1.69 at σ=0.9, q=0.05, 3 steps). Use 'prv' "
               "(default), 'rdp' or 'pld'.")

History = list[tuple[float, float, int]]  # (noise_multiplier, sample_rate, steps), as Opacus stores it


def check_accountant(accountant: str, neighboring: str = "add_remove") -> None:
    """Raise `ValueError` naming the fix unless (accountant, neighbouring relation) is one this library reports."""
    if accountant == "gdp":
        raise ValueError(GDP_REFUSED)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; use one of {ACCOUNTANTS}.")
    if neighboring not in NEIGHBORING_RELATIONS:
        raise ValueError(f"unknown neighbouring relation {neighboring!r}; use one of {NEIGHBORING_RELATIONS}.")
    if neighboring == "replace_one" and accountant != "pld":
        raise ValueError(f"neighboring='replace_one' needs accountant='pld' (dp_accounting); Opacus' "
                         f"{accountant!r} accountant covers add/remove neighbours only.")


def compute_epsilon(history: History, delta: float, accountant: str = "prv",
                    neighboring: str = "add_remove") -> float:
    """ε spent by a history of DP-SGD phases [(σ, q, steps), ...]; ∞ if any phase had σ = 0."""
    check_accountant(accountant, neighboring)
    steps = merge_history([(float(s), float(q), int(t)) for s, q, t in history if t > 0])
    if not steps:
        return 0.0
    if any(s == 0 for s, _, _ in steps):
        return math.inf
    return _epsilon(tuple(steps), float(delta), accountant, neighboring)


@functools.lru_cache(maxsize=4096)  # a run asks again for the same history (each log line, ledger, card)
def _epsilon(steps: tuple, delta: float, accountant: str, neighboring: str) -> float:
    if accountant == "pld":
        return _pld_epsilon(steps, delta, neighboring)
    acc = create_accountant(mechanism=accountant)
    acc.history = [tuple(h) for h in steps]
    with _full_batch(steps), warnings.catch_warnings():
        # An RDP remark that asks for nothing here (quiet.py): PRV only bounds its domain with RDP; under 'rdp' the
        # order grid is Opacus' own and the ε reported stays an upper bound ('prv', the default, is tighter).
        warnings.filterwarnings("ignore", message=RDP_LARGEST_ALPHA, category=UserWarning)
        return float(acc.get_epsilon(delta=delta))


def _pld_epsilon(history: History, delta: float, neighboring: str) -> float:
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    relation = dp_accounting.NeighboringRelation
    acc = PLDAccountant(relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=PLD_DISCRETIZATION)
    for sigma, q, steps in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def calibrate_noise_multiplier(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str = "prv",
    neighboring: str = "add_remove",
) -> float:
    """Smallest σ (to within 0.1 % of ε) such that `steps` steps at `sample_rate` spend at most `target_epsilon`."""
    if steps <= 0:
        raise ValueError(f"calibrate_noise_multiplier: steps must be > 0, got {steps}.")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"calibrate_noise_multiplier: sample_rate must be in (0, 1], got {sample_rate}.")
    try:
        return calibrate_last_phase(target_epsilon, target_delta, [], sample_rate, steps, accountant,
                                    neighboring=neighboring)
    except OutOfReachError:
        raise ValueError(too_low_message(target_epsilon, target_delta, sample_rate, steps, accountant,
                                         neighboring)) from None


def calibrate_last_phase(
    target_epsilon: float, target_delta: float, fixed: History, sample_rate: float, steps: int,
    accountant: str = "prv", same_sigma: bool = False, neighboring: str = "add_remove",
) -> float:
    """σ of a last phase of `steps` steps at `sample_rate` such that `fixed` phases followed by it spend
    target_epsilon (within 0.1 %, never above). With `same_sigma`, the `fixed` phases' σ is replaced by the
    same σ (one σ calibrated on the whole composition). Bisection on `compute_epsilon`."""

    def eps(sigma: float) -> float:
        head = [(sigma, q, t) for _, q, t in fixed] if same_sigma else list(fixed)
        try:
            return compute_epsilon(head + [(sigma, sample_rate, steps)], target_delta, accountant, neighboring)
        except (ValueError, OverflowError, FloatingPointError):
            return math.inf  # σ too small for the accountant's numerics: certainly above any sane target

    check_accountant(accountant, neighboring)
    if not same_sigma and compute_epsilon(fixed, target_delta, accountant, neighboring) >= target_epsilon:
        raise ValueError("calibrate_last_phase: the earlier phases already spend the whole target ε; give them "
                         "a smaller share of the budget.")
    low, high = 0.0, 1.0
    while (eps_high := eps(high)) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise OutOfReachError(f"target_epsilon={target_epsilon:g} is out of reach: even σ = {high:g} spends "
                                  f"ε = {eps_high:.4g} (the '{accountant}' accountant's floor"
                                  f"{'' if same_sigma else ' with the earlier phases'}); set target_epsilon above it.")
    while eps_high < (1 - RELATIVE_EPSILON_TOLERANCE) * target_epsilon and high - low > 1e-9:
        mid = (low + high) / 2
        if (eps_mid := eps(mid)) > target_epsilon:
            low = mid
        else:
            high, eps_high = mid, eps_mid
    return high


def _full_batch(history: History):
    """q = 1 (every example in every batch: no amplification by sampling) is exact in Opacus' accountants, but
    the PRV one evaluates log(1 - q) = -inf on a branch it then discards, with a RuntimeWarning: silence that."""
    return np.errstate(divide="ignore") if any(q == 1 for _, q, _ in history) else contextlib.nullcontext()


def merge_history(history: History) -> History:
    """Merge consecutive entries with the same (σ, q), as Opacus' accountants do when stepping."""
    out: History = []
    for s, q, t in history:
        if out and out[-1][:2] == (s, q):
            out[-1] = (s, q, out[-1][2] + t)
        else:
            out.append((s, q, t))
    return out


# ---- why a target ε is out of reach, in numbers -------------------------------------------------------------
# Opacus' accountants cannot certify an ε below their own floor (what they report for σ → ∞, i.e. pure noise), and
# their calibration then only says "The privacy budget is too low."


def epsilon_floor(delta: float, sample_rate: float, steps: int, accountant: str,
                  neighboring: str = "add_remove") -> float:
    """The smallest ε `accountant` reports for `steps` steps at `sample_rate`: its value at Opacus' largest σ."""
    return compute_epsilon([(MAX_SIGMA, sample_rate, steps)], delta, accountant, neighboring)


def too_low_message(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
                    neighboring: str = "add_remove") -> str:
    """What the accountant can certify for this schedule, and what σ a reachable target would take."""
    floor = epsilon_floor(delta, sample_rate, steps, accountant, neighboring)
    reachable = _round_up(2 * floor)
    sigma = calibrate_noise_multiplier(reachable, delta, sample_rate, steps, accountant, neighboring)
    lines = [
        f"target_epsilon={target_epsilon:g} (δ={delta:g}) is below what the '{accountant}' accountant can certify "
        f"for {steps} steps at sample rate q={sample_rate:.4g}: even with σ → ∞ (pure noise) it reports "
        f"ε = {floor:.4g}, its resolution limit; fewer steps or a smaller q lower the σ needed, not this floor.",
        f"Reachable: target_epsilon={reachable:g} takes σ = {sigma:.4g}.",
    ]
    for other in ACCOUNTANTS if neighboring == "add_remove" else ():  # replace-one: only 'pld' computes it
        if other != accountant:
            other_floor = epsilon_floor(delta, sample_rate, steps, other)
            verdict = "certifies" if other_floor < target_epsilon else "cannot certify"
            lines.append(f"accountant='{other}' {verdict} it (its floor here: ε = {other_floor:.4g}).")
    return " ".join(lines)


def _round_up(x: float) -> float:
    """`x` rounded up to two significant digits (a target a person would type)."""
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / scale) * scale


def __getattr__(name: str):
    # PrivacyPlan, PrivacyLedger, Phase and LEDGER_FILE live in ledger.py (which imports this module): still
    # importable from here, with a DeprecationWarning.
    return moved_attribute(__name__, name)
