"""Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping"): the clipping norm
C follows a target quantile γ of the per-example (per-unit) gradient norms, from a noisy count released with each step.

At each step t, every example i of the logical batch (every unit, with a privacy unit) adds b_i − 1/2 to a count,
b_i = 1 if ||g_i|| ≤ C_t (not clipped), else 0. The count is summed over the micro-batches and the processes, then
noised once: b̃_t = (Σ_i (b_i − 1/2) + N(0, σ_b²)) / L + 1/2, L the expected logical batch; then

    C_{t+1} = C_t · exp(−η (b̃_t − γ)).

C_t depends only on C_0 and the noisy counts b̃_0..b̃_{t−1}: it is a DP quantity (logged, checkpointed, on the card).

Accounting. Scale the gradient coordinates by 1/(σ_eff·C_t) and the count by 1/σ_b: the step releases the sum over
the batch of each example's vector f(x) = (clip(g)/(σ_eff·C_t), (b − 1/2)/σ_b) plus N(0, I). Its norm satisfies
||f(x)||² ≤ σ_eff⁻² + (2σ_b)⁻² (the count part is always exactly (2σ_b)⁻²: values ±1/2, not 0/1, so this holds under
add/remove, where an example's whole contribution appears or vanishes). With

    σ⁻² = σ_eff⁻² + (2σ_b)⁻²,  i.e.  σ_eff = (σ⁻² − (2σ_b)⁻²)^(−1/2)  (needs 2σ_b > σ),

the step is exactly DP-SGD with clipping norm 1/σ and unit noise, i.e. noise multiplier σ: every accountant's ε for
σ holds, for both neighbouring relations (replace-one: two examples' vectors differ by at most 2/σ, as DP-SGD's
clipped gradients differ by 2C; the count by at most 1 and the clipped sum by at most 2C_t). So the plan's phases
keep the total σ (what the accountant sees and `target_epsilon` calibrates), and the gradient gets σ_eff·C_t.

Example:
    >>> spec = AdaptiveClipping.parse("quantile=0.5,learning_rate=0.2,count_noise=5")
    >>> round(gradient_noise_multiplier(1.0, spec.count_noise), 4)  # (1 − 1/100)^(−1/2)
    1.005
    >>> round(next_clip_norm(1.0, noisy_unclipped_fraction(-2.0, 8), spec), 4)  # 1/4 of 8 below C: C grows
    1.0513
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import DPConfigError

# Andrew et al. (2021), section 3: η_C = 0.2 (geometric update), γ = 0.5, σ_b = expected batch / 20.
DEFAULT_LEARNING_RATE = 0.2
COUNT_NOISE_PER_BATCH = 1 / 20
_KEYS = ("quantile", "learning_rate", "count_noise", "count_share")


@dataclass(frozen=True)
class AdaptiveClipping:
    """The adaptive-clipping settings of a plan: the target quantile γ, the learning rate η_C and σ_b, the count's
    noise std, given, or from `count_share` (the share of σ⁻² the count takes: (2σ_b)⁻² = share·σ⁻²), or else the
    expected batch / 20 (None until the plan resolves it, `resolved`)."""

    quantile: float = 0.5
    learning_rate: float = DEFAULT_LEARNING_RATE
    count_noise: float | None = None
    count_share: float | None = None

    def __post_init__(self):
        if not 0 < self.quantile < 1:
            raise DPConfigError(f"adaptive_clipping: quantile={self.quantile} must be in (0, 1) (e.g. 0.5, the median "
                                "gradient norm).")
        if not self.learning_rate > 0:
            raise DPConfigError(f"adaptive_clipping: learning_rate={self.learning_rate} must be > 0 (e.g. 0.2).")
        if self.count_noise is not None and not self.count_noise >= 0:
            raise DPConfigError(f"adaptive_clipping: count_noise={self.count_noise} (σ_b) must be >= 0.")
        if self.count_share is not None and not 0 < self.count_share < 1:
            raise DPConfigError(f"adaptive_clipping: count_share={self.count_share} must be in (0, 1) (e.g. 0.1: the "
                                "count takes a tenth of σ⁻², the gradient's noise grows by 1/√0.9, 5 %).")

    @classmethod
    def parse(cls, value) -> "AdaptiveClipping":
        """From 'quantile=0.5,learning_rate=0.2,count_noise=5' (any subset; '' or 'on': the defaults), a dict of the
        same keys, or an AdaptiveClipping."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            items = [] if text in ("", "on", "true", "True") else [p.split("=", 1) for p in text.split(",")]
            if any(len(p) != 2 for p in items):
                raise DPConfigError(f"adaptive_clipping={value!r}: write 'key=value,...' with keys {_KEYS}.")
            value = {k.strip(): v.strip() for k, v in items}
        if not isinstance(value, dict) or any(k not in _KEYS for k in value):
            raise DPConfigError(f"adaptive_clipping={value!r}: give a dict or 'key=value,...' with keys {_KEYS}.")
        try:
            numbers = {k: float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            raise DPConfigError(f"adaptive_clipping={value!r}: every value must be a number.") from None
        return cls(**numbers)

    def __str__(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in asdict(self).items() if v is not None)

    def resolved(self, expected_batch_size: int, sigma: float) -> "AdaptiveClipping":
        """σ_b fixed: the given one; from count_share for the largest phase σ `sigma` (smaller σ: a smaller share);
        else Andrew et al.'s expected batch / 20."""
        if self.count_noise is not None and self.count_share is not None:
            raise DPConfigError("adaptive_clipping: give count_noise (σ_b) or count_share, not both.")
        if self.count_noise is not None:
            return self
        noise = (sigma / (2 * math.sqrt(self.count_share)) if self.count_share is not None else
                 COUNT_NOISE_PER_BATCH * expected_batch_size)
        return AdaptiveClipping(self.quantile, self.learning_rate, noise, self.count_share)


def gradient_noise_multiplier(sigma: float, count_noise: float) -> float:
    """σ_eff = (σ⁻² − (2σ_b)⁻²)^(−1/2): the gradient's noise multiplier when the count takes its share of a total σ.
    σ = 0 (a non-private reference): 0. Refuses 2σ_b ≤ σ (the count alone would spend more than the whole σ)."""
    if sigma == 0:
        return 0.0
    if not 2 * count_noise > sigma:
        raise DPConfigError(
            f"adaptive_clipping: count_noise σ_b = {count_noise:.4g} is too small for the total noise multiplier "
            f"σ = {sigma:.4g}: the count and the gradient share σ as σ⁻² = σ_eff⁻² + (2σ_b)⁻², which needs "
            f"2σ_b > σ; set adaptive_clipping count_noise above {sigma / 2:.4g}, or count_share=0.1 (σ_b from σ: "
            "the count takes a tenth of σ⁻²).")
    return (sigma ** -2 - (2 * count_noise) ** -2) ** -0.5


def noisy_unclipped_fraction(noisy_shifted_count: float, expected_batch_size: int) -> float:
    """b̃ = (Σ(b_i − 1/2) + noise) / L + 1/2: the noisy fraction of the logical batch whose norm was ≤ C."""
    return noisy_shifted_count / expected_batch_size + 0.5


def next_clip_norm(clip_norm: float, noisy_fraction: float, spec: AdaptiveClipping) -> float:
    """C ← C · exp(−η (b̃ − γ)) (Andrew et al.'s geometric update)."""
    return clip_norm * math.exp(-spec.learning_rate * (noisy_fraction - spec.quantile))
