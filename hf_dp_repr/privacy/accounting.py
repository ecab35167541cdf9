"""Privacy accounting: σ calibration and ε of a history (the plan and the ledger of a run: `ledger.py`). σ is
calibrated for a target ε (`calibrate_noise_multiplier`, `calibrate_last_phase`) or for a target attack rate
(`calibrate_for_attack`: the largest TPR of a membership test at an FPR, `attack_rates.py`), by one bracketing search
(`calibrate_sigma`).

Every ε reported by this library comes from `compute_epsilon`, i.e. from a real accountant run on the history of
(σ, sample rate, steps) that was actually executed: dp_accounting's `pld` (privacy loss distributions, the default
and the only one here that also does replace-one neighbours), Opacus' `prv` or `rdp`, or one registered in
`accountants.py` (`register_accountant`). Opacus' `gdp` is refused: its central-limit approximation is not an upper
bound and under-reports ε for DP-SGD. A target ε below what an
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

import functools
import math

from ..errors import ArgumentError, OutOfReachError
from .accountants import (  # noqa: F401 (ACCOUNTANTS, NEIGHBORING_RELATIONS, GDP_REFUSED: importable from here)
    ACCOUNTANTS,
    GDP_REFUSED,
    NEIGHBORING_RELATIONS,
    History,
    accountants_for,
    check_accountant,
)
from .attack_rates import AttackTarget, tpr_at_fpr

# The largest σ calibration tries: Opacus' bound (opacus.accountants.utils.MAX_SIGMA), kept here so that this
# module imports neither Opacus nor torch.
MAX_SIGMA = 1e6
# Calibrated σ spends between (1 - tolerance)·ε and ε: tight enough that "exactly the target" holds to 0.1 %.
RELATIVE_EPSILON_TOLERANCE = 1e-3


def target_epsilon_problem(eps: float) -> str | None:
    """Why `eps` cannot be a target ε (None if it can): NaN, ∞ (no budget: Opacus' calibration would return
    its upper bracket σ = 10, a chance-level model), or ≤ 0."""
    if math.isnan(eps):
        return "target_epsilon is NaN; give a finite ε > 0 (e.g. 8.0), or noise_multiplier=0 for a non-private run."
    if eps == math.inf:
        return ("target_epsilon=inf is no privacy budget: no σ is calibrated for it (Opacus would return an arbitrary "
                "σ = 10 and a chance-level model). For a non-private reference set noise_multiplier=0 instead of "
                "target_epsilon (clipping only, ε reported as ∞).")
    if not eps > 0:
        return f"target_epsilon must be > 0, got {eps}."
    return None


def compute_epsilon(history: History, delta: float, accountant: str = "prv",
                    neighboring: str = "add_remove") -> float:
    """ε spent by a history of DP-SGD phases [(σ, q, steps), ...]; ∞ if any phase had σ = 0."""
    check_accountant(accountant, neighboring)
    steps = merge_history([(float(s), float(q), int(t)) for s, q, t in history if t > 0])
    if not steps:
        return 0.0
    if any(s == 0 for s, _, _ in steps):
        return math.inf
    return _epsilon(tuple(steps), float(delta), ACCOUNTANTS[accountant], neighboring)


@functools.lru_cache(maxsize=4096)  # a run asks again for the same history (each log line, ledger, card)
def _epsilon(steps: tuple, delta: float, accountant, neighboring: str) -> float:
    return float(accountant.epsilon(steps, delta, neighboring))


def calibrate_noise_multiplier(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str = "prv",
    neighboring: str = "add_remove",
) -> float:
    """Smallest σ (to within 0.1 % of ε) such that `steps` steps at `sample_rate` spend at most `target_epsilon`."""
    if steps <= 0:
        raise ArgumentError(f"calibrate_noise_multiplier: steps must be > 0, got {steps}.")
    if not 0 < sample_rate <= 1:
        raise ArgumentError(f"calibrate_noise_multiplier: sample_rate must be in (0, 1], got {sample_rate}.")
    try:
        return calibrate_last_phase(target_epsilon, target_delta, [], sample_rate, steps, accountant,
                                    neighboring=neighboring)
    except OutOfReachError:
        raise OutOfReachError(too_low_message(target_epsilon, target_delta, sample_rate, steps, accountant,
                                              neighboring)) from None


def calibrate_last_phase(
    target_epsilon: float, target_delta: float, fixed: History, sample_rate: float, steps: int,
    accountant: str = "prv", same_sigma: bool = False, neighboring: str = "add_remove",
) -> float:
    """σ of a last phase of `steps` steps at `sample_rate` such that `fixed` phases followed by it spend
    target_epsilon (within 0.1 %, never above). With `same_sigma`, the `fixed` phases' σ is replaced by the
    same σ (one σ calibrated on the whole composition). A bracketing search on `compute_epsilon` (`calibrate_sigma`)."""
    check_accountant(accountant, neighboring)
    if not same_sigma and compute_epsilon(fixed, target_delta, accountant, neighboring) >= target_epsilon:
        raise OutOfReachError("calibrate_last_phase: the earlier phases already spend the whole target ε; give "
                              "them a smaller share of the budget.")
    return calibrate_sigma(lambda history: compute_epsilon(history, target_delta, accountant, neighboring),
                           target_epsilon, fixed, sample_rate, steps, same_sigma,
                           target_name=f"target_epsilon={target_epsilon:g}",
                           measure=f"ε (the '{accountant}' accountant's floor)")


def calibrate_sigma(spend, target: float, fixed: History, sample_rate: float, steps: int, same_sigma: bool = False,
                    floor: float = 0.0, target_name: str = "the target", measure: str = "the measure") -> float:
    """The smallest σ of a last phase of `steps` steps at `sample_rate` after the `fixed` phases (their σ replaced by
    it with `same_sigma`) such that `spend(history)` is at most `target`, and above it by no more than 0.1 % of
    `target - floor`. `spend` falls as σ grows, towards `floor` (its value for pure noise): ε (`floor` 0), or the
    largest TPR of a membership test at an FPR (`floor` that FPR; `attack_rates.calibrate_for_attack`).

    A bracket [low, high] with spend(low) > target ≥ spend(high) shrinks until spend(high) is within the tolerance;
    the next σ is where the secant through the two ends crosses a point near the top of the band, in log σ and
    log(spend − floor), where spend is close to a straight line (ε ∝ 1/σ for large σ), with Illinois' halving of an
    end kept twice (or the bracket's middle while no finite low end is known): about 4-6 accountant calls where a
    bisection needed 12-16. Whatever the route, the answer is checked on the accountant, as a bisection's."""

    def value(sigma: float) -> float:
        head = [(sigma, q, t) for _, q, t in fixed] if same_sigma else list(fixed)
        try:
            return spend(head + [(sigma, sample_rate, steps)])
        except (ValueError, OverflowError, FloatingPointError):
            return math.inf  # σ too small for the accountant's numerics: certainly above any sane target

    enough = floor + (1 - RELATIVE_EPSILON_TOLERANCE) * (target - floor)
    aim = floor + (1 - RELATIVE_EPSILON_TOLERANCE / 4) * (target - floor)  # near the top: ε = 1 prints as 1

    def gap(v: float) -> float:  # log distance from the aim; the root of this, in log σ, is the σ sought
        return math.log((v - floor) / (aim - floor)) if v > floor else -math.inf

    def secant(low: float, gap_low: float, high: float, gap_high: float) -> float:
        """Where the line through (log σ, gap) at both points crosses 0 (nan when it does not slope down)."""
        if not (low > 0 and math.isfinite(gap_low) and math.isfinite(gap_high) and gap_low > gap_high):
            return math.nan
        x_low, x_high = math.log(low), math.log(high)
        x = x_high - gap_high * (x_high - x_low) / (gap_high - gap_low)
        return math.exp(x) if x < math.log(MAX_SIGMA) + 1 else math.inf  # a near-flat line: far past any σ tried

    low, high, value_low = 0.0, 1.0, math.inf
    while (value_high := value(high)) > target:  # grow σ until the target is met: 2×, or past the secant's σ
        if high >= MAX_SIGMA:
            raise OutOfReachError(f"{target_name} is out of reach: even σ = {high:g} gives {measure} "
                                  f"{value_high:.4g}{'' if same_sigma or not fixed else ' with the earlier phases'}; "
                                  "set the target above it.")
        ahead = secant(low, gap(value_low), high, gap(value_high))
        grown = max(2 * high, min(1.2 * ahead, 1000 * high)) if math.isfinite(ahead) else 2 * high
        low, value_low, high = high, value_high, min(grown, MAX_SIGMA)

    gap_low, gap_high, kept = gap(value_low), gap(value_high), None
    while value_high < enough and high - low > 1e-9:
        mid = (low + high) / 2
        if low < (guess := secant(low, gap_low, high, gap_high)) < high:
            mid = guess
        if (value_mid := value(mid)) > target:
            low, value_low, gap_low = mid, value_mid, gap(value_mid)
            gap_high, kept = (gap_high / 2, None) if kept == "high" else (gap_high, "high")
        else:
            high, value_high, gap_high = mid, value_mid, gap(value_mid)
            gap_low, kept = (gap_low / 2, None) if kept == "low" else (gap_low, "low")
    return high


def calibrate_for_attack(target: AttackTarget, fixed, sample_rate: float, steps: int, neighboring: str,
                         same_sigma: bool = False) -> float:
    """σ of a last phase, as `calibrate_last_phase` but for an attack-rate target: the smallest σ (the
    same search, `accounting.calibrate_sigma`) such that the whole history's largest TPR at `target.fpr` is at
    most `target.tpr` (and within 0.1 % of `target.tpr − target.fpr` below it), for `neighboring` neighbours.

    Example (one full-batch step: the closed form Φ(Φ⁻¹(0.01) + 1/σ) = 0.05 at σ ≈ 1.467):
        >>> from hf_dp_repr.privacy.attack_rates import AttackTarget
        >>> round(calibrate_for_attack(AttackTarget(0.05, 0.01), [], 1.0, 1, "add_remove"), 3)
        1.468
    """
    if not same_sigma and tpr_at_fpr(fixed, target.fpr, neighboring) >= target.tpr:
        raise OutOfReachError(f"target_attack_tpr_at_fpr={target}: the earlier phases already allow a TPR above "
                              f"{target.tpr:g}; give them more noise.")
    return calibrate_sigma(lambda history: tpr_at_fpr(history, target.fpr, neighboring), target.tpr, fixed,
                           sample_rate, steps, same_sigma, floor=target.fpr,
                           target_name=f"target_attack_tpr_at_fpr={target}",
                           measure=f"a largest TPR at FPR {100 * target.fpr:g} % of")


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
# An accountant cannot certify an ε below its own floor (what it reports for σ → ∞, i.e. pure noise), and Opacus'
# calibration then only says "The privacy budget is too low."


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
    for other in accountants_for(neighboring):  # the others that compute ε for this relation
        if other != accountant:
            other_floor = epsilon_floor(delta, sample_rate, steps, other, neighboring)
            verdict = "certifies" if other_floor < target_epsilon else "cannot certify"
            lines.append(f"accountant='{other}' {verdict} it (its floor here: ε = {other_floor:.4g}).")
    return " ".join(lines)


def _round_up(x: float) -> float:
    """`x` rounded up to two significant digits (a target a person would type)."""
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / scale) * scale

