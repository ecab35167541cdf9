"""Opacus DP optimizers adapted to the Trainer's gradient accumulation.

Opacus' optimizers clip and noise in one `step()`. Under gradient accumulation that would keep the
per-sample gradients of a whole logical batch in memory. Here each micro-batch is clipped right after its
backward (`accumulate_micro_batch`, by a registered `privacy.clipping_modes` mode), the clipped sum is kept, and
`step()` hands the sums to a `privacy.reduction` strategy, which noises them once per logical batch, sums over
processes and divides by the expected global batch size ("ddp": noise on rank 0):

    update = (Σ_i clip_C(g_i) + N(0, σ²C²)) / L,    L = per_device_batch × accumulation × processes.

With a unit of privacy other than the row (`privacy.units`), g_i is the sum of the per-row gradients of unit i;
a unit cut by a micro-batch boundary is kept summed but unclipped (`_open_unit`) until its last rows arrive. With
`whole_units=True` (sharded runs, whose sampler never cuts a unit) the ghost engine clips each unit in its
micro-batch from its norm ||Σ_rows G_r|| (`GhostClippingEngine.squared_norms(groups)`).

With adaptive clipping (`adapt_clip_norm`, `privacy.adaptive_clipping`), each clipped example (unit) also adds
b − 1/2 to the step's count (b = 1 if its norm is ≤ C); at the step the count is noised once and C updated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _generate_noise

from ..errors import UnsupportedError
from .adaptive_clipping import AdaptiveClipping, next_clip_norm, noisy_unclipped_fraction
from .clipping_modes import clip_factors, clipping_mode
from .reduction import NoisySum, Reduction, replicated
from .units import sum_per_unit


class MicroBatchDPOptimizer(DPOptimizer):
    """An Opacus DPOptimizer that clips per micro-batch and adds noise once per logical step.

    clipping: a registered `privacy.clipping_modes` mode ("flat", "per_layer", "automatic", ...).
    Norms, clip factors and the clipped sum are float32 whatever the parameters' dtype: in bf16 an example's
    contribution reached 1.0003·C. `noise_generator(device, shard=None)` returns the generator of the current
    step's noise (`privacy.randomness`): never torch's global RNG, which the Trainer seeds from the public `seed`.
    `reduction`: how the clipped sums become the released gradient (`privacy.reduction`; default "ddp").
    `ghost`: a `GhostClippingEngine` giving per-example norms and clipped sums, or None: per-sample gradients
    from Opacus hooks (`grad_sample`). `whole_units`: every micro-batch holds whole units (the sampler's
    `whole_units=True`), so the ghost engine may clip units; a unit met again in the same step is refused.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, clipping: str, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: int,
                 noise_generator: Callable[..., torch.Generator], secure_mode: bool = False,
                 world_size: int = 1, rank: int = 0, ghost=None, reduction: Reduction = replicated,
                 whole_units: bool = False):
        clipping_mode(clipping)  # a registered mode, or a ValueError listing them
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction="mean", secure_mode=secure_mode)
        self.clipping = clipping
        self.noise_generator = noise_generator
        self.world_size = world_size
        self.rank = rank
        self._open_unit: tuple[int, list[torch.Tensor]] | None = None  # (id, partial per-row sums), not yet clipped
        self._closed_units: set[int] = set()  # units clipped in this logical step: none may come back
        self.ghost = ghost
        self.reduction = reduction
        self.whole_units = whole_units
        # The clipped sums before noise, per parameter: kept here, never on the parameters, where callbacks (at
        # on_pre_optimizer_step) and trackers would read them (Opacus keeps them as `p.summed_grad`).
        self._clipped_sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.adaptive: AdaptiveClipping | None = None  # set by `adapt_clip_norm`
        self.count_noise_generator: Callable[[], torch.Generator] | None = None
        self._count: torch.Tensor | float = 0.0  # Σ (b_i − 1/2) of this step's examples (units) on this process

    def adapt_clip_norm(self, spec: AdaptiveClipping, count_noise_generator: Callable[[], torch.Generator]) -> None:
        """Adaptive clipping from now on: `spec` (σ_b resolved); `count_noise_generator()`: the current step's
        count-noise generator (the run's secret, its own stream). C is `max_grad_norm`, updated after each step;
        `noise_multiplier` must be the gradient's σ_eff (the engine sets both)."""
        if self.clipping != "flat":
            raise UnsupportedError(f"MicroBatchDPOptimizer: adaptive clipping follows a quantile of the whole "
                                   f"gradient's norm; clipping={self.clipping!r} clips otherwise: use 'flat'.")
        self.adaptive, self.count_noise_generator = spec, count_noise_generator

    def accumulate_micro_batch(self, unit_ids: torch.Tensor | None = None, stand_in: bool = False) -> None:
        """Clip the per-sample gradients of the micro-batch just back-propagated, add them to the clipped sum
        and free them. A no-op after an empty micro-batch. With `unit_ids` (each row's unit), rows are summed
        per unit first and each unit is clipped once (`_accumulate_units` with Opacus hooks; with the ghost engine
        only for `whole_units`). `stand_in`: the micro-batch was a stand-in row run only so that this rank joins the
        collectives of a sharded run (its own micro-batch was empty): its clip factors are 0, it adds nothing."""
        if self.ghost is not None:
            if unit_ids is not None and not self.whole_units:  # a unit may be cut: never clip its parts as units
                raise UnsupportedError("MicroBatchDPOptimizer: the ghost clipping engine clips units only when each "
                                       "micro-batch holds whole units (sharded runs); use the hooks engine "
                                       "(clipping_engine='hooks').")
            return self._accumulate_from_ghost(stand_in, unit_ids)
        if stand_in:
            raise UnsupportedError("MicroBatchDPOptimizer: stand-in rows (sharded runs) need the ghost clipping "
                                   "engine.")
        missing = [p for p in self.params if getattr(p, "grad_sample", None) is None]
        if len(missing) == len(self.params):
            return
        if missing:
            raise self._missing_error(missing)
        if unit_ids is None:
            self.clip_and_accumulate()
        else:
            self._accumulate_units(unit_ids)
        self._drop_unclipped()

    @staticmethod
    def _missing_error(missing) -> RuntimeError:
        names = ", ".join(getattr(p, "_dp_name", str(tuple(p.shape))) for p in missing)
        return RuntimeError(
            f"These trainable parameters got no per-sample gradient in the forward pass: {names}. They are "
            "unused by the model's forward; freeze them (requires_grad=False) so DP-SGD does not train them."
        )

    def _accumulate_from_ghost(self, stand_in: bool = False, unit_ids: torch.Tensor | None = None) -> None:
        """The same clipping from the ghost engine's per-example norms (no per-example gradient held). Each tensor's
        clipped sum is folded (`reduction.fold`: kept whole, or this rank's rows of it when sharded) as soon as it
        is formed. With `unit_ids` (whole units): one norm and clip factor per unit, which each of its rows takes."""
        if not self.ghost.has_gradients():
            return
        groups = None
        if unit_ids is not None:
            units, groups = torch.unique(unit_ids, return_inverse=True)
            if not stand_in:  # (a stand-in row adds nothing: its unit is not clipped here)
                self._close_units(units.tolist(), None)
        norms = self.ghost.squared_norms(groups)
        missing = [p for p in self.params if p not in norms]
        if missing:
            raise self._missing_error(missing)
        norms = torch.stack([norms[p] for p in self.params], dim=1).float().clamp(min=0).sqrt()
        factors = self.clip_factors(norms)
        if not stand_in:  # (a stand-in row is no example: it is not counted)
            self._count_unclipped(norms)
        if groups is not None:
            factors = factors[groups.to(factors.device)]  # each row: its unit's factor
        if stand_in:
            factors = torch.zeros_like(factors)
        fold = getattr(self.reduction, "fold", None)
        for p, total in self.ghost.each_clipped_sum({p: factors[:, j] for j, p in enumerate(self.params)}):
            if fold is not None:
                total = fold(p, total)
            self._add_clipped(p, total)
        self._drop_unclipped()

    def _drop_unclipped(self) -> None:
        for p in self.params:
            # The summed, unclipped gradient is not private: drop it so nothing can read or log it.
            p.grad_sample = None
            p.grad = None

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-example, per-tensor clip factors (batch, tensors) from float32 norms of the same shape."""
        return clip_factors(self.clipping, norms, self.max_grad_norm)

    def clip_and_accumulate(self, grads: list[torch.Tensor] | None = None) -> None:
        """Clip each example's gradient (rows of `grads`, one (examples, numel) float32 matrix per parameter;
        default: the micro-batch's per-sample gradients) and add them to the clipped sum."""
        if grads is None:
            grads = [g.reshape(len(g), -1).float() for g in self.grad_samples]
        norms = torch.stack([g.norm(2, dim=1) for g in grads], dim=1)
        factors = self.clip_factors(norms)
        self._count_unclipped(norms)
        for j, (p, g) in enumerate(zip(self.params, grads)):
            clipped = (factors[:, j] @ g).view(p.shape)
            self._add_clipped(p, clipped)

    def _count_unclipped(self, norms: torch.Tensor) -> None:
        """Adaptive clipping: add Σ (b_i − 1/2) of these examples' (units') norms (rows of `norms`, per tensor)."""
        if self.adaptive is not None:
            below = (norms.norm(2, dim=1) <= self.max_grad_norm).to(torch.float64)
            self._count = self._count + (below - 0.5).sum()

    def _noisy_count(self) -> float:
        """The step's count Σ (b_i − 1/2) summed over the processes, plus N(0, σ_b²) once: rank 0 adds it to its own
        count before the sum (as the gradient's noise; the same value on every rank)."""
        device = self.params[0].device
        count = torch.as_tensor(self._count, dtype=torch.float64).reshape(1).cpu()
        self._count = 0.0
        if self.rank == 0 and self.adaptive.count_noise > 0:
            count = count + _generate_noise(std=self.adaptive.count_noise, reference=count,
                                            generator=self.count_noise_generator(), secure_mode=self.secure_mode)
        if self.world_size > 1:
            count = count.to(device)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        return float(count.item())

    def _add_clipped(self, p: torch.nn.Parameter, clipped: torch.Tensor) -> None:
        held = self._clipped_sums.get(p)  # the step's own sum (a fresh tensor): added to in place
        same = held is not None and torch.promote_types(held.dtype, clipped.dtype) == held.dtype
        self._clipped_sums[p] = clipped if held is None else held.add_(clipped) if same else held + clipped

    def _accumulate_units(self, unit_ids: torch.Tensor) -> None:
        """Sum the rows of each unit; clip and add every unit that ends in this micro-batch; keep the unit of
        the last row open (it may continue in the next micro-batch: the sampler lays units out contiguously)."""
        ids, sums = sum_per_unit([g.reshape(len(g), -1).float() for g in self.grad_samples], unit_ids.to(
            self.params[0].device))
        ids = ids.tolist()
        if self._open_unit is not None:
            open_id, partial = self._open_unit
            self._open_unit = None
            if ids[0] == open_id:
                sums = [torch.cat([s[:1] + q, s[1:]]) for s, q in zip(sums, partial)]
            else:
                self._close_units([open_id], partial)
        self._close_units(ids[:-1], [s[:-1] for s in sums])
        self._check_not_closed(ids[-1])
        self._open_unit = (ids[-1], [s[-1:] for s in sums])

    def _check_not_closed(self, unit: int) -> None:
        if unit in self._closed_units:
            # Clipping a unit twice would let it contribute 2C: a broken guarantee, never a silent one.
            raise UnsupportedError(f"DP-SGD: unit {unit} appears again after it was clipped in this logical step; the "
                                   "rows of a unit must be contiguous across micro-batches (UnitPoissonBatchSampler).")

    def _close_units(self, ids: list[int], sums: list[torch.Tensor] | None) -> None:
        """Mark units clipped in this step (refusing one seen before) and clip their summed gradients `sums`
        (None: the caller clips them)."""
        for unit in ids:
            self._check_not_closed(unit)
        self._closed_units.update(ids)
        if ids and sums is not None:
            self.clip_and_accumulate(sums)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As Opacus' (which drops its `summed_grad`): the gradients and the clipped sums so far."""
        super().zero_grad(set_to_none)
        self._clipped_sums = {}
        self._count = 0.0

    def pre_step(self, closure=None) -> bool:
        """update = the reduction of the clipped sums (default "ddp": Σ clipped + N(0, σ²C²) on rank 0, summed over
        ranks, / expected global batch)."""
        self.accumulate_micro_batch()
        if self._open_unit is not None:
            self._close_units([self._open_unit[0]], self._open_unit[1])
            self._open_unit = None
        self._closed_units = set()
        sums = [self._clipped_sums.pop(p) if p in self._clipped_sums else _zero_sum(p) for p in self.params]
        self._clipped_sums = {}
        grads = self.reduction(NoisySum(
            self.params, sums, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size, noise_generator=self.noise_generator,
            secure_mode=self.secure_mode, rank=self.rank, world_size=self.world_size))
        for p, grad in zip(self.params, grads):
            p.grad = grad.to(p.dtype)
        if self.adaptive is not None:  # after the noise (σ_eff · this step's C): C of the next step
            fraction = noisy_unclipped_fraction(self._noisy_count(), self.expected_batch_size)
            self.max_grad_norm = next_clip_norm(self.max_grad_norm, fraction, self.adaptive)
        if self.step_hook:
            self.step_hook(self)
        return True


def _zero_sum(p: torch.nn.Parameter) -> torch.Tensor:
    """Nothing accumulated for p: zeros of what this process holds of it (its rows, when p is sharded)."""
    held = p.to_local() if hasattr(p, "to_local") else p
    return torch.zeros(held.shape, device=held.device)
