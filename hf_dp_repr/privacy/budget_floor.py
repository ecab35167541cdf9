"""Why a target ε is out of reach, in numbers: Opacus' accountants cannot certify an ε below their own floor
(what they report for σ → ∞, i.e. pure noise), and their calibration then only says "The privacy budget is
too low."

Example:
    >>> from hf_dp_repr.privacy.budget_floor import epsilon_floor
    >>> round(epsilon_floor(delta=1e-5, sample_rate=0.01, steps=1000, accountant="prv"), 5)  # PRV's resolution
    0.00999
"""

from __future__ import annotations

import math

from opacus.accountants.utils import MAX_SIGMA

def epsilon_floor(delta: float, sample_rate: float, steps: int, accountant: str,
                  neighboring: str = "add_remove") -> float:
    """The smallest ε `accountant` reports for `steps` steps at `sample_rate`: its value at Opacus' largest σ."""
    from .accounting import compute_epsilon

    return compute_epsilon([(MAX_SIGMA, sample_rate, steps)], delta, accountant, neighboring)


def too_low_message(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
                    neighboring: str = "add_remove") -> str:
    """What the accountant can certify for this schedule, and what σ a reachable target would take."""
    from .accounting import ACCOUNTANTS, calibrate_noise_multiplier

    floor = epsilon_floor(delta, sample_rate, steps, accountant, neighboring)
    reachable = _round_up(2 * floor)
    sigma = calibrate_noise_multiplier(reachable, delta, sample_rate, steps, accountant, neighboring)
    lines = [
        f"target_epsilon={target_epsilon:g} (δ={delta:g}) is below what the '{accountant}' accountant can certify "
        f"for {steps} steps at sample rate q={sample_rate:.4g}: even with σ → ∞ (pure noise) it reports ε = {floor:.4g}, "
        "its resolution limit; fewer steps or a smaller q lower the σ needed, not this floor.",
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
