"""The plan of a DP run and its ledger, kept apart as Opacus keeps an accountant's configuration apart from its state.

- `PrivacyPlan` (frozen): what the run will do, fixed before its first step: the phases (σ, sample rate q, steps,
  expected batch), the accountant, δ, the target (ε or an attack rate), C, the clipping, n, the neighbouring
  relation, where the randomness comes from, the unit of privacy and the number of processes.
  `plan.planned_epsilon()` is ε at its end.
- `PrivacyLedger(plan, steps_done)`: how far the run has got. `record_step()` accounts one noisy update (and
  refuses one past the plan), `epsilon()` is ε spent so far, `save(dir)`/`load(dir)` write and read
  `privacy_ledger.json`, the file every checkpoint carries (its format is unchanged by this split).
  `recomputed_steps`: steps an interrupted run computed after its last checkpoint, then lost and computed again
  on resume (with fresh noise): they are charged too, so ε may end above the plan's (written only when some are).

Example:
    >>> plan = PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
    ...                    dataset_size=100, poisson_sampling=True, phases=[Phase("train", 1.0, 0.1, 3, 10)])
    >>> ledger = PrivacyLedger(plan)
    >>> ledger.record_step(); ledger.record_step()
    >>> ledger.steps_done, ledger.history, ledger.epsilon() < plan.planned_epsilon()
    (2, [(1.0, 0.1, 2)], True)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass

from ..errors import LedgerError, PrivacyBudgetExhaustedError
from .accounting import History, compute_epsilon, merge_history
from .adaptive_clipping import AdaptiveClipping, gradient_noise_multiplier
from .attack_rates import AttackRates, attack_rates

LEDGER_FILE = "privacy_ledger.json"
# Keys of the ledger file computed from the plan and the position; read back only to be checked.
_DERIVED = ("history", "steps_done", "planned_steps", "epsilon", "epsilon_by_phase", "recomputed_steps",
            "gradient_noise_multipliers")
_STATE = ("clip_norms",)  # the ledger's own state beside the step count (adaptive clipping's C after each step)


@dataclass(frozen=True)
class Phase:
    """One stretch of a run with fixed σ, sample rate and expected batch (a linear probe, a fine-tune, ...)."""

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    expected_batch_size: int


@dataclass(frozen=True)
class PrivacyPlan:
    """What a DP run will do, fixed before its first step (see the module docstring); compared field by field with
    a checkpoint's plan on resume (`hf_dp_repr.training.plan.RESUME_INVARIANTS`).

    `neighboring` is the relation ε is stated for; `randomness` says where the noise and the batches come from:
    "os-entropy" (a secret no one holds) or "seeded" (`noise_seed`: reproducible, and NOT private).
    `privacy_unit` is what ε protects ("row", or a column such as "document_id": all rows sharing a value);
    `dataset_size` counts units.
    """

    accountant: str
    target_delta: float
    per_sample_max_grad_norm: float
    clipping: str
    dataset_size: int
    poisson_sampling: bool
    phases: tuple[Phase, ...]
    target_epsilon: float | None = None
    world_size: int = 1
    neighboring: str = "add_remove"
    randomness: str = "os-entropy"
    privacy_unit: str = "row"
    # σ calibrated for an attack rate instead of ε ("TPR@FPR", `attack_rates.AttackTarget`); None: not asked.
    target_attack_tpr_at_fpr: str | None = None
    # Adaptive clipping (`privacy.adaptive_clipping`): C follows a quantile of the norms, from a noisy count that
    # takes its share of each phase's σ; None: C fixed at per_sample_max_grad_norm.
    adaptive_clipping: AdaptiveClipping | None = None

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))  # a list passed in cannot change the plan later
        if isinstance(self.adaptive_clipping, dict):  # (from a ledger file)
            object.__setattr__(self, "adaptive_clipping", AdaptiveClipping(**self.adaptive_clipping))

    def gradient_noise_multiplier(self, index: int) -> float:
        """The noise multiplier of phase `index`'s gradient: its σ, or σ_eff with adaptive clipping (the count takes
        the rest of σ; the accountant sees σ)."""
        sigma = self.phases[index].noise_multiplier
        if self.adaptive_clipping is None:
            return sigma
        return gradient_noise_multiplier(sigma, self.adaptive_clipping.count_noise)

    @property
    def planned_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_index(self, step: int) -> int:
        """Index of the phase that step `step` (0-based) belongs to (the last one past the end)."""
        end = 0
        for i, phase in enumerate(self.phases):
            end += phase.steps
            if step < end:
                return i
        return len(self.phases) - 1

    def sample_rate_at(self, step: int) -> float:
        """Sample rate of the phase that step `step` (0-based) belongs to (what the Poisson sampler asks)."""
        return self.phases[self.phase_index(step)].sample_rate

    def history(self, steps: int | None = None) -> History:
        """The accountant's history [(σ, q, steps), ...] of the first `steps` steps (default: all of the plan)."""
        left = self.planned_steps if steps is None else steps
        out = []
        for p in self.phases:
            out.append((p.noise_multiplier, p.sample_rate, min(left, p.steps)))
            left -= out[-1][2]
        return merge_history([h for h in out if h[2] > 0])

    def epsilon(self, steps: int | None = None) -> float:
        """ε of the first `steps` steps (default: the whole plan), by the plan's accountant."""
        return compute_epsilon(self.history(steps), self.target_delta, self.accountant, self.neighboring)

    def planned_epsilon(self) -> float:
        return self.epsilon()

    def epsilon_by_phase(self, steps: int) -> dict[str, float]:
        """ε of each phase's part of the first `steps` steps on its own (their composition is `epsilon(steps)`,
        not their sum)."""
        out, start = {}, 0
        for phase in self.phases:
            done = min(max(steps - start, 0), phase.steps)
            out[phase.name] = compute_epsilon([(phase.noise_multiplier, phase.sample_rate, done)],
                                              self.target_delta, self.accountant, self.neighboring)
            start += phase.steps
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phases"] = [asdict(p) for p in self.phases]
        if self.target_attack_tpr_at_fpr is None:  # written only when asked: other ledger files stay as they were
            del d["target_attack_tpr_at_fpr"]
        if self.adaptive_clipping is None:
            del d["adaptive_clipping"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PrivacyPlan":
        """The plan of a `to_dict()` (or of a ledger file's plan keys); older files lack the fields with defaults."""
        return cls(**{**d, "phases": tuple(Phase(**p) for p in d["phases"])})


@dataclass(slots=True)
class PrivacyLedger:
    """A run's plan and its position in it: what it has spent. Written into every checkpoint, restored on resume.

    The plan's fields are `ledger.plan.<field>` (`ledger.plan.phases`, `ledger.plan.target_delta`, ...); reading them
    through the ledger (`ledger.target_delta`, as when the plan and the ledger were one object) still works, with a
    DeprecationWarning. The ledger itself only counts steps.
    """

    plan: PrivacyPlan
    steps_done: int = 0
    # Inclusive ranges (first, last) of steps (numbered 1.. as global_step) computed a second time after a resume.
    recomputed_steps: tuple[tuple[int, int], ...] = ()
    # Adaptive clipping: C after each step taken (a DP quantity: from C_0 and the noisy counts alone).
    clip_norms: tuple[float, ...] = ()

    def __post_init__(self):
        if not 0 <= self.steps_done <= self.plan.planned_steps:
            raise LedgerError(f"PrivacyLedger: steps_done={self.steps_done} is outside the plan's "
                              f"0..{self.plan.planned_steps} steps.")
        self.recomputed_steps = tuple((int(a), int(b)) for a, b in self.recomputed_steps)
        if not all(1 <= a <= b <= self.plan.planned_steps for a, b in self.recomputed_steps):
            raise LedgerError(f"PrivacyLedger: recomputed_steps={self.recomputed_steps} are not ranges of the plan's "
                              f"1..{self.plan.planned_steps} steps.")
        self.clip_norms = tuple(float(c) for c in self.clip_norms)
        if self.clip_norms and not self.has_trajectory:  # (none: a ledger that only counts steps, e.g. resume's)
            raise LedgerError(f"PrivacyLedger: {len(self.clip_norms)} clip norms for {self.steps_done} steps "
                              f"{'with' if self.plan.adaptive_clipping else 'without'} adaptive clipping.")

    @property
    def has_trajectory(self) -> bool:
        """With adaptive clipping: C is known after every step taken (what a run continues from)."""
        return self.plan.adaptive_clipping is not None and len(self.clip_norms) == self.steps_done

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "plan":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        value = getattr(self.plan, name)  # an AttributeError for a name the plan lacks too
        warnings.warn(f"PrivacyLedger.{name} reads the plan through the ledger; use ledger.plan.{name} (the "
                      "forwarding goes in 0.3)", DeprecationWarning, stacklevel=2)
        return value

    @property
    def history(self) -> History:
        """The accountant's history [(σ, q, steps), ...] of the steps taken (and of those computed again)."""
        phases = self.plan.phases
        again = [(phases[i].noise_multiplier, phases[i].sample_rate, 1) for i in self._recomputed_phases()]
        return merge_history(self.plan.history(self.steps_done) + again)

    def _recomputed_phases(self) -> list[int]:
        """The phase index of every step computed again."""
        return [self.plan.phase_index(step - 1) for first, last in self.recomputed_steps
                for step in range(first, last + 1)]

    def phase_index(self, step: int | None = None) -> int:
        """Index of the phase that step `step` (0-based; default: the next step) belongs to."""
        return self.plan.phase_index(self.steps_done if step is None else step)

    @property
    def phase(self) -> Phase:
        """The phase of the next step (the last one once the plan is done)."""
        return self.plan.phases[self.phase_index()]

    # The current phase's parameters, as the optimizer and sampler need them.
    @property
    def noise_multiplier(self) -> float:
        return self.phase.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return self.phase.sample_rate

    @property
    def expected_batch_size(self) -> int:
        return self.phase.expected_batch_size

    @property
    def clip_norm(self) -> float:
        """C of the next step: per_sample_max_grad_norm, or with adaptive clipping C after the last step taken."""
        return self.clip_norms[-1] if self.clip_norms else self.plan.per_sample_max_grad_norm

    def record_step(self, clip_norm: float | None = None) -> None:
        """Account for one noisy update; refuses to go past the planned steps (the budget). `clip_norm`: with
        adaptive clipping, C after this step (from its noisy count)."""
        if self.steps_done >= self.plan.planned_steps:
            raise PrivacyBudgetExhaustedError(
                f"Privacy budget exhausted: {self.steps_done} of {self.plan.planned_steps} planned DP steps are done. "
                "Refusing to take another noisy step; plan a longer run (and a new budget) instead."
            )
        if (clip_norm is None) != (self.plan.adaptive_clipping is None):
            raise LedgerError("PrivacyLedger.record_step: a clip_norm is recorded with adaptive clipping, and only "
                              "then.")
        self.steps_done += 1
        if clip_norm is not None:
            self.clip_norms += (float(clip_norm),)

    def epsilon(self) -> float:
        """ε spent by the steps taken (and by those computed again)."""
        if not self.recomputed_steps:
            return self.plan.epsilon(self.steps_done)
        return compute_epsilon(self.history, self.plan.target_delta, self.plan.accountant, self.plan.neighboring)

    def epsilon_by_phase(self) -> dict[str, float]:
        by_phase = self.plan.epsilon_by_phase(self.steps_done)
        again = self._recomputed_phases()
        for index in sorted(set(again)):
            phase, plan = self.plan.phases[index], self.plan
            done = min(max(self.steps_done - sum(p.steps for p in plan.phases[:index]), 0), phase.steps)
            by_phase[phase.name] = compute_epsilon([(phase.noise_multiplier, phase.sample_rate,
                                                     done + again.count(index))],
                                                   plan.target_delta, plan.accountant, plan.neighboring)
        return by_phase

    def attack_rates(self) -> AttackRates:
        """What the steps taken allow a membership attacker, for the plan's neighbouring relation: the largest TPR
        at FPR 0.1 %, 1 %, 10 % and the largest advantage (`attack_rates.py`, from this history's PLD)."""
        return attack_rates(self.history, self.plan.neighboring)

    def summary(self) -> str:
        """ε spent and what it means for an attacker, in words (the end-of-training log line)."""
        eps, plan = self.epsilon(), self.plan
        relation = plan.neighboring.replace("_", "/" if plan.neighboring == "add_remove" else "-")
        if not math.isfinite(eps):
            return (f"{self.steps_done} of {plan.planned_steps} DP steps taken: NOT differentially private (ε = ∞, "
                    "no noise).")
        target = plan.target_attack_tpr_at_fpr
        return (f"{self.steps_done} of {plan.planned_steps} DP steps taken: (ε = {eps:.4g}, δ = {plan.target_delta:g})"
                f"-DP for {relation} neighbours ({plan.accountant}); {self.attack_rates().describe()}"
                + ("" if target is None else f" (σ calibrated for target_attack_tpr_at_fpr={target})"))

    def to_dict(self) -> dict:
        """The ledger file's content: the plan's fields, then the history, the position and ε."""
        d = self.plan.to_dict()
        d["history"] = [list(h) for h in self.history]
        d["steps_done"] = self.steps_done
        if self.recomputed_steps:  # only after an interrupted run was resumed: other files stay as they were
            d["recomputed_steps"] = [list(r) for r in self.recomputed_steps]
        d["planned_steps"] = self.plan.planned_steps
        if self.plan.adaptive_clipping is not None:  # σ_eff of each phase's gradient, and C's trajectory
            d["gradient_noise_multipliers"] = [self.plan.gradient_noise_multiplier(i)
                                               for i in range(len(self.plan.phases))]
            d["clip_norms"] = list(self.clip_norms)
        # ε = ∞ (σ = 0) is written as null: bare Infinity is not JSON.
        d["epsilon"] = _finite_or_none(self.epsilon())
        if len(self.plan.phases) > 1:
            d["epsilon_by_phase"] = {k: _finite_or_none(v) for k, v in self.epsilon_by_phase().items()}
        return d

    def save(self, directory: str) -> str:
        """Write `privacy_ledger.json` into `directory` atomically: ε is computed first, the text goes to a temporary
        file that is flushed to disk, then renamed over the ledger; a kill leaves the old file or the new, whole."""
        path = os.path.join(directory, LEDGER_FILE)
        write_atomically(path, json.dumps(self.to_dict(), indent=2, allow_nan=False))
        return path

    @classmethod
    def load(cls, directory: str) -> "PrivacyLedger":
        """The ledger saved in `directory`; FileNotFoundError if there is none, ValueError naming the file if it
        cannot be read or its history is not the one its plan gives."""
        path = os.path.join(directory, LEDGER_FILE)
        with open(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
            history = [(float(s), float(q), int(t)) for s, q, t in d["history"]]
            plan = PrivacyPlan.from_dict({k: v for k, v in d.items() if k not in _DERIVED + _STATE})
            recomputed = tuple(tuple(r) for r in d.get("recomputed_steps", ()))
            steps = int(d["steps_done"]) if recomputed else sum(t for _, _, t in history)
            ledger = cls(plan, steps, recomputed, tuple(d.get("clip_norms", ())))
            if plan.adaptive_clipping is not None and not ledger.has_trajectory:
                raise LedgerError(f"adaptive clipping's C is missing for some of its {steps} steps")
            if ledger.history != history:
                raise LedgerError(f"its history {history} is not the plan's first {ledger.steps_done} steps "
                                  f"{ledger.history}")
            return ledger
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise LedgerError(
                f"PrivacyLedger: {path} is corrupted ({type(e).__name__}: {e}); the privacy spent up to that "
                "checkpoint cannot be read, so it cannot be resumed or reported. Resume from an earlier checkpoint "
                "whose ledger is intact (resume_from_checkpoint='<output_dir>/checkpoint-N'), or start a new run; "
                "never rewrite a ledger by hand."
            ) from None


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def write_atomically(path: str, text: str, durable: bool = True) -> None:
    """Write `text` to `path` through a temporary file in the same folder, renamed over it: a killed process leaves
    the old file or the new one, whole. `durable`: flushed to disk first, so that a power loss does too."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
