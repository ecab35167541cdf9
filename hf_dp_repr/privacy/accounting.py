"""Privacy accounting on Opacus' accountants: σ calibration, ε of a history, and the ledger a run carries.

Every ε reported by this library comes from `compute_epsilon`, i.e. from an Opacus accountant run on
the history of (σ, sample rate, steps) that was actually executed.

Example:
    >>> from hf_dp_repr.privacy.accounting import calibrate_noise_multiplier, compute_epsilon
    >>> sigma = calibrate_noise_multiplier(target_epsilon=8.0, target_delta=1e-5, sample_rate=0.01, steps=1000)
    >>> eps = compute_epsilon([(sigma, 0.01, 1000)], delta=1e-5)
    >>> 7.9 <= eps <= 8.0
    True
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

LEDGER_FILE = "privacy_ledger.json"
# Calibrated σ spends between (1 - tolerance)·ε and ε: tight enough that "exactly the target" holds to 0.1 %.
RELATIVE_EPSILON_TOLERANCE = 1e-3

History = list[tuple[float, float, int]]  # (noise_multiplier, sample_rate, steps), as Opacus stores it


def compute_epsilon(history: History, delta: float, accountant: str = "prv") -> float:
    """ε spent by a history of DP-SGD phases under `accountant`; ∞ if any phase had σ = 0."""
    steps = [(s, q, t) for s, q, t in history if t > 0]
    if not steps:
        return 0.0
    if any(s == 0 for s, _, _ in steps):
        return math.inf
    acc = create_accountant(mechanism=accountant)
    acc.history = [tuple(h) for h in steps]
    return float(acc.get_epsilon(delta=delta))


def calibrate_noise_multiplier(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str = "prv"
) -> float:
    """Smallest σ (to within 0.1 % of ε) such that `steps` steps at `sample_rate` spend at most `target_epsilon`."""
    if steps <= 0:
        raise ValueError(f"calibrate_noise_multiplier: steps must be > 0, got {steps}.")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"calibrate_noise_multiplier: sample_rate must be in (0, 1], got {sample_rate}.")
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=RELATIVE_EPSILON_TOLERANCE * target_epsilon,
        )
    )


@dataclass
class PrivacyLedger:
    """What a DP run has spent and how: written into every checkpoint, restored on resume.

    `history` is the accountant's own history [(σ, q, steps), ...]; `epsilon()` recomputes ε from it.
    """

    accountant: str
    target_delta: float
    noise_multiplier: float
    sample_rate: float
    planned_steps: int
    per_sample_max_grad_norm: float
    clipping: str
    expected_batch_size: int
    dataset_size: int
    poisson_sampling: bool
    target_epsilon: float | None = None
    world_size: int = 1
    history: History = field(default_factory=list)

    @property
    def steps_done(self) -> int:
        return sum(t for _, _, t in self.history)

    def record_step(self) -> None:
        """Account for one noisy update; refuses to go past the planned steps (the budget)."""
        if self.steps_done >= self.planned_steps:
            raise RuntimeError(
                f"Privacy budget exhausted: {self.steps_done} of {self.planned_steps} planned DP steps are done. "
                "Refusing to take another noisy step; plan a longer run (and a new budget) instead."
            )
        if self.history and tuple(self.history[-1][:2]) == (self.noise_multiplier, self.sample_rate):
            s, q, t = self.history[-1]
            self.history[-1] = (s, q, t + 1)
        else:
            self.history.append((self.noise_multiplier, self.sample_rate, 1))

    def epsilon(self) -> float:
        return compute_epsilon(self.history, self.target_delta, self.accountant)

    def planned_epsilon(self) -> float:
        return compute_epsilon(
            [(self.noise_multiplier, self.sample_rate, self.planned_steps)], self.target_delta, self.accountant
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["history"] = [list(h) for h in self.history]
        d["steps_done"] = self.steps_done
        d["epsilon"] = self.epsilon()
        return d

    def save(self, directory: str) -> str:
        path = os.path.join(directory, LEDGER_FILE)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path

    @classmethod
    def load(cls, directory: str) -> "PrivacyLedger":
        with open(os.path.join(directory, LEDGER_FILE)) as f:
            d = json.load(f)
        d.pop("steps_done", None)
        d.pop("epsilon", None)
        d["history"] = [(float(s), float(q), int(t)) for s, q, t in d["history"]]
        return cls(**d)
