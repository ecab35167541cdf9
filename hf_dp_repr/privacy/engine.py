"""`DPEngine`: the DP-SGD machinery of one run, built from its `PrivacyPlan` alone.

The plan is the single source of truth for what the guarantee depends on: σ, q and the steps of each phase, C, the
clipping mode, the unit of privacy, the accountant, δ, the neighbouring relation and the number of processes.
`EngineOptions` holds the mechanics that never change ε (so they are in neither the plan nor the ledger): which
clipper (auto / ghost / hooks), secure_mode, max_rows_per_unit, micro-batches per step, this process's rank, and
the reduction strategy of the clipped sums (`privacy.reduction`: "ddp", or "fsdp2" for a model sharded by FSDP2,
`privacy.sharding`).

The engine owns: the run's secret `randomness`; the batch `sampler` (Poisson / shuffled / unit Poisson); the
`clipper` on the model (`privacy.clippers`: ghost norms, or Opacus hooks, the fallback logged with its reason);
the `optimizer` (a `MicroBatchDPOptimizer` wrapping the one given, with C and the mode from the plan); the `ledger`
(new, or a checkpoint's already checked by the caller); the current `phase` (σ and expected batch); ε (cached per
step); and what happens after each noisy step: the ledger's `record_step`, then every `after_step(ledger)` hook.

Example (one DP step of a linear model, without a Trainer):
    >>> import torch
    >>> from hf_dp_repr.privacy.engine import DPEngine
    >>> from hf_dp_repr.privacy.ledger import Phase, PrivacyPlan
    >>> from hf_dp_repr.privacy.randomness import DPRandomness
    >>> plan = PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
    ...                    dataset_size=8, poisson_sampling=True, phases=[Phase("train", 1.0, 0.5, 2, 4)],
    ...                    randomness="seeded")
    >>> engine = DPEngine(plan, randomness=DPRandomness(noise_seed=0))
    >>> model, x, y = torch.nn.Linear(3, 1), torch.randn(8, 3), torch.randn(8, 1)
    >>> optimizer = engine.start(torch.optim.SGD(model.parameters(), lr=0.1), model)
    >>> for rows in engine.batch_sampler():  # the secret Poisson batch of each step
    ...     _ = engine.enter_phase()
    ...     with engine.recording(len(rows)):
    ...         ((model(x[rows]) - y[rows]) ** 2).sum().backward()  # the sum of per-example losses
    ...     engine.after_backward()
    ...     optimizer.step()
    >>> engine.detach(model)
    >>> engine.clipping_engine, engine.ledger.steps_done, engine.epsilon() > 0
    ('ghost', 2, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ArgumentError, LedgerError
from .attributes import clear_dp_attributes
from .clippers import CLIPPERS, choose_clipper
from .ledger import PrivacyLedger, PrivacyPlan
from .optimizer import MicroBatchDPOptimizer
from .randomness import DPRandomness
from .reduction import reduction
from .sampler import PoissonBatchSampler, ShuffledBatchSampler
from .sharding import is_sharded, parameter_keys
from .units import ROW, UnitPoissonBatchSampler

# What the engine takes from a checkpoint's ledger must be its own plan's (the caller checked the whole plan).
_MECHANICS = ("phases", "per_sample_max_grad_norm", "clipping", "privacy_unit", "world_size", "adaptive_clipping")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs. Nothing here changes ε: none of it is in the plan or the ledger."""

    clipping_engine: str = "auto"  # "auto", or a registered clipper ("ghost", "hooks")
    secure_mode: bool = False  # batches from OS entropy, Opacus' secure noise
    max_rows_per_unit: int | None = None  # with a privacy unit: rows of a unit kept per step
    micro_batches_per_step: int = 1  # the Trainer's gradient_accumulation_steps
    rank: int = 0
    reduction: str = "ddp"  # `privacy.reduction.REDUCTIONS`: "fsdp2" for a sharded model
    views_per_example: int = 1  # augmentation multiplicity: each example's views, rows of one unit (`augmentation`)

    def __post_init__(self):
        if self.clipping_engine != "auto" and self.clipping_engine not in CLIPPERS:
            raise ArgumentError(f"unknown clipping_engine {self.clipping_engine!r}; use one of "
                                f"{('auto', *CLIPPERS)}.")
        reduction(self.reduction)  # registered, or a ValueError listing them

    @property
    def whole_units(self) -> bool:
        """Micro-batches hold whole units (the ghost engine clips units): sharded runs, where the hooks engine, which
        carries a cut unit over to the next micro-batch, cannot run; and an example's views (never cut)."""
        return self.reduction == "fsdp2" or self.views_per_example > 1


class DPEngine:
    """The DP machinery of one run (see the module docstring). `randomness` must be the run's (fresh for every
    run; None: an engine that only reports a finished run's `ledger`). `log`: where its lines go."""

    def __init__(self, plan: PrivacyPlan, options: EngineOptions | None = None,
                 randomness: DPRandomness | None = None, ledger: PrivacyLedger | None = None,
                 log: logging.Logger | None = None):
        if randomness is not None and randomness.kind != plan.randomness:
            raise ArgumentError(f"DPEngine: the plan's randomness is {plan.randomness!r}, the run's "
                                f"{randomness.kind!r}.")
        self.plan, self.options, self.randomness = plan, options or EngineOptions(), randomness
        self.log = log or logging.getLogger(__name__)
        self.ledger = ledger
        self.sampler = None
        self.clipper = None
        self.clipping_engine: str | None = None  # the clipper that ran last ("ghost" or "hooks"), kept after detach
        self.optimizer: MicroBatchDPOptimizer | None = None
        self.phase: int | None = None  # index of the phase whose σ and batch the optimizer has
        self.after_step: list[Callable[[PrivacyLedger], None]] = []
        self._several = frozenset()
        self._epsilon: tuple | None = None

    # ---- data ------------------------------------------------------------------------------------------
    def batch_sampler(self, row_units=None):
        """The run's logical batches, split into the micro-batches of each step; `row_units` (each row's unit
        index) with a privacy unit. Poisson (from the plan's sample rate of each step), else shuffled."""
        plan, opt = self.plan, self.options
        if (row_units is None) != (plan.privacy_unit == ROW):
            raise ArgumentError(f"DPEngine: privacy_unit={plan.privacy_unit!r} needs each row's unit, and only then.")
        n, batch = plan.dataset_size, plan.phases[-1].expected_batch_size
        common = dict(steps_per_epoch=max(1, n // batch), micro_batches_per_step=opt.micro_batches_per_step,
                      world_size=plan.world_size, rank=opt.rank, seed=self.randomness.sampling_seed())
        if row_units is not None:
            self.sampler = UnitPoissonBatchSampler(row_units, n, sample_rate=plan.sample_rate_at,
                                                   secure=opt.secure_mode, max_rows_per_unit=opt.max_rows_per_unit,
                                                   whole_units=opt.whole_units, **common)
        elif plan.poisson_sampling:
            self.sampler = PoissonBatchSampler(num_samples=n, sample_rate=plan.sample_rate_at, secure=opt.secure_mode,
                                               **common)
        else:
            self.sampler = ShuffledBatchSampler(num_samples=n, batch_size=batch, **common)
        return self.sampler

    # ---- clipping on the model --------------------------------------------------------------------------
    def attach(self, model: nn.Module, several=None):
        """Put the clipper on `model`'s trained tensors (a no-op when one is on). `several`: paths of modules that
        see several rows per example (`privacy.batch_rows`)."""
        if several is not None:
            self._several = frozenset(several)
        if self.clipper is not None:
            return self.clipper
        for name, p in model.named_parameters():
            p._dp_name = name  # for error messages that name the parameter
        name, reason = choose_clipper(self.options.clipping_engine, model, self.plan)
        if reason is not None:
            self.log.warning(f"DPTrainer: per-example clipping falls back to {CLIPPERS[name].label}: {reason}.")
        if name != self.clipping_engine:
            self.log.info(f"DPTrainer: clipping_engine={name!r} (per-example clipping {CLIPPERS[name].how}).")
        self.clipping_engine = name
        # sharded: the clipper keys each use by the sharded parameter (hooks refuse sharded models: `unsupported`)
        keys = {"key_of": parameter_keys(model)} if is_sharded(model) else {}
        self.clipper = CLIPPERS[name](model, several=self._several, **keys)
        if self.optimizer is not None:
            self.optimizer.ghost = self.clipper.ghost
        return self.clipper

    def remove(self) -> None:
        """Take the clipper off the model (`attach` puts one back, e.g. on the next phase's tensors)."""
        if self.clipper is not None:
            self.clipper.remove()
            self.clipper = None

    def reattach(self, model: nn.Module):
        self.remove()
        return self.attach(model)

    def detach(self, model: nn.Module) -> None:
        """The run is over: the clipper off, and the DP bookkeeping cleared from the parameters."""
        self.remove()
        clear_dp_attributes(model.parameters())

    def recording(self, batch_size: int):
        """Around one micro-batch's forward and backward (`batch_size` examples)."""
        return self.clipper.recording(batch_size)

    # ---- the optimizer ---------------------------------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer, model: nn.Module, ledger: PrivacyLedger | None = None,
              several=None) -> MicroBatchDPOptimizer:
        """The DP optimizer around `optimizer` (its parameters: every phase's), the clipper on `model`, and the
        ledger: new, or `ledger` (a checkpoint's, already checked against the plan by the caller)."""
        if ledger is not None:
            changed = [k for k in _MECHANICS if getattr(ledger.plan, k) != getattr(self.plan, k)]
            if changed:
                raise LedgerError(f"DPEngine: the checkpoint's ledger is for another plan ({', '.join(changed)}).")
        if is_sharded(model) != (self.options.reduction == "fsdp2"):
            raise ArgumentError(f"DPEngine: reduction={self.options.reduction!r} for a model that is "
                                f"{'' if is_sharded(model) else 'not '}sharded; sharded models take 'fsdp2'.")
        self.ledger = PrivacyLedger(self.plan) if ledger is None else ledger
        self.attach(model, several)
        plan, phase = self.plan, self.ledger.phase
        if plan.adaptive_clipping is not None and self.ledger.steps_done and not self.ledger.has_trajectory:
            raise LedgerError("DPEngine: the checkpoint's ledger lacks adaptive clipping's C after each step; the run "
                              "cannot continue its C. Resume from a checkpoint written by this version.")
        self.optimizer = MicroBatchDPOptimizer(
            optimizer, clipping=plan.clipping,
            noise_multiplier=plan.gradient_noise_multiplier(self.ledger.phase_index()),
            max_grad_norm=self.ledger.clip_norm, expected_batch_size=phase.expected_batch_size,
            noise_generator=self._noise_generator, world_size=plan.world_size, rank=self.options.rank,
            secure_mode=self.options.secure_mode, ghost=self.clipper.ghost, reduction=reduction(self.options.reduction),
            whole_units=self.options.whole_units)
        if plan.adaptive_clipping is not None:  # the count's noise: the run's secret, its own stream per step
            self.optimizer.adapt_clip_norm(plan.adaptive_clipping,
                                           lambda: self.randomness.count_noise_generator(self.ledger.steps_done))
        self.optimizer.attach_step_hook(lambda _optimizer: self._after_step())
        self.phase = None
        return self.optimizer

    def _noise_generator(self, device, shard: int | None = None) -> torch.Generator:
        """The noise stream of the step being taken (and of one shard of the parameters, when sharded)."""
        return self.randomness.noise_generator(self.ledger.steps_done, device, shard)

    def _after_step(self) -> None:
        """One noisy step computed: accounted, then the hooks (e.g. recorded on disk before anything is logged)."""
        adaptive = self.plan.adaptive_clipping is not None
        self.ledger.record_step(self.optimizer.max_grad_norm if adaptive else None)  # C of the next step
        for hook in self.after_step:
            hook(self.ledger)

    def enter_phase(self) -> int | None:
        """Before each micro-batch: when the next step starts a new phase, give the optimizer its σ and expected
        batch and return its index (the caller then trains the phase's scope and calls `reattach`); else None."""
        index = self.ledger.phase_index()
        if index == self.phase:
            return None
        phase = self.plan.phases[index]
        self.optimizer.noise_multiplier = self.plan.gradient_noise_multiplier(index)  # σ_eff with adaptive clipping
        self.optimizer.expected_batch_size = phase.expected_batch_size
        self.phase = index
        return index

    def after_backward(self, unit_ids: torch.Tensor | None = None, stand_in: bool = False) -> None:
        """After a micro-batch's backward: clip each example (each unit, with `unit_ids`) and add to the sum.
        `stand_in`: a row run only to join a sharded run's collectives (this rank's micro-batch was empty)."""
        self.optimizer.accumulate_micro_batch(unit_ids, stand_in)

    # ---- privacy spent ---------------------------------------------------------------------------------
    def epsilon(self) -> float:
        """ε spent so far, by the plan's accountant (cached per step)."""
        key = (id(self.ledger), self.ledger.steps_done, self.ledger.recomputed_steps)
        if self._epsilon is None or self._epsilon[0] != key:
            self._epsilon = (key, self.ledger.epsilon())
        return self._epsilon[1]

    def epsilon_by_phase(self) -> dict[str, float]:
        """ε of each phase's steps on its own (their composition is `epsilon()`)."""
        return self.ledger.epsilon_by_phase()
