"""How the clipped sums of one logical step become the released gradient: summed over the processes, noised
once, divided by the expected batch. A registry of strategies; `EngineOptions.reduction` picks one.

A strategy is two functions: `fold(p, clipped_sum)`, what this process keeps of one micro-batch's clipped sum of p
(called as soon as each is formed; default: all of it), and the step function, from what was kept to the released
gradient of each parameter.

"ddp" (every process holds every parameter whole: one process, or DDP): rank 0 adds N(0, σ²C²) to its clipped
sum of each tensor, the sums are all-reduced and divided by the expected global batch L:

    grad = (Σ_ranks Σ_i clip_C(g_i) + N(0, σ²C²)) / L.

"fsdp2" (parameters sharded on dim 0 over the processes, `privacy.sharding`): each micro-batch's clipped sum is
reduce-scattered (SUM) into the rank's rows at once (`fold`); at the step each rank adds N(0, σ²C²) to the rows it
owns, from its own stream of the run's secret (`step.noise_generator(device, shard=rank)`), and divides by L. The
rows of the ranks are disjoint and cover every coordinate: noise once per coordinate, as "ddp".

Example (a strategy is a function of a `NoisySum`; this one is "ddp" written out for one process):
    >>> import torch
    >>> from hf_dp_repr.privacy.reduction import REDUCTIONS, NoisySum, register_reduction
    >>> @register_reduction("one_process")
    ... def one_process(step: NoisySum) -> list[torch.Tensor]:
    ...     gen = step.noise_generator(step.params[0].device) if step.noise_multiplier > 0 else None
    ...     noise = [torch.normal(0.0, step.std, s.shape, generator=gen) if gen else 0 for s in step.sums]
    ...     return [(s + z) / step.expected_batch_size for s, z in zip(step.sums, noise)]
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> step = NoisySum([p], [torch.tensor([2.0, 4.0])], noise_multiplier=0.0, max_grad_norm=1.0,
    ...                 expected_batch_size=2, noise_generator=None)
    >>> REDUCTIONS["one_process"](step)
    [tensor([1., 2.])]
    >>> del REDUCTIONS["one_process"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from opacus.optimizers.optimizer import _generate_noise

from ..registry import Registry


@dataclass(frozen=True)
class NoisySum:
    """One logical step's inputs to a reduction strategy (this process's view)."""

    params: list[torch.nn.Parameter]
    sums: list[torch.Tensor]  # what this process kept (`fold`) of each clipped sum, float32; the step's own (in place)
    noise_multiplier: float  # σ of the current phase
    max_grad_norm: float  # C
    expected_batch_size: int  # L, the expected global logical batch of the current phase
    noise_generator: Callable[..., torch.Generator] | None  # (device, shard=None): this step's noise stream
    secure_mode: bool = False
    rank: int = 0
    world_size: int = 1

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.max_grad_norm


Reduction = Callable[[NoisySum], list[torch.Tensor]]  # the released gradient of each parameter (float32)
Fold = Callable[[torch.nn.Parameter, torch.Tensor], torch.Tensor]  # (p, a micro-batch's clipped sum) -> what is kept
REDUCTIONS = Registry("reduction")


def keep_whole(p: torch.nn.Parameter, clipped_sum: torch.Tensor) -> torch.Tensor:
    return clipped_sum


def register_reduction(name: str, fold: Fold = keep_whole, *, replace: bool = False
                       ) -> Callable[[Reduction], Reduction]:
    """Register a strategy under `name`; `fold`: what a process keeps of each micro-batch's clipped sum (see the
    module docstring). The step function gets it as its `fold` attribute."""
    def register(strategy: Reduction) -> Reduction:
        REDUCTIONS.add(name, strategy, replace=replace)
        strategy.fold = fold
        return strategy
    return register


def reduction(name: str) -> Reduction:
    return REDUCTIONS.lookup(name)


class _NoiseDraws:
    """Adds N(0, std²) to each sum in turn, in place (the sums are the step's own, fresh tensors), drawn from the
    step's generator one tensor at a time: exactly the draws of Opacus' `_generate_noise` (one `normal_` per tensor,
    same generator, same order; `test_randomness`), without its zeros and copies. The draws go into one buffer,
    reused: on CPU the cost is the numbers drawn, not the calls (GPT-2 124M: 148 tensors, 124M numbers).
    secure_mode keeps Opacus' function (its draws differ on purpose). No generator: nothing is added."""

    def __init__(self, step: NoisySum, generator: torch.Generator | None):
        self.step, self.generator, self._buffer = step, generator, None

    def add_to(self, total: torch.Tensor) -> torch.Tensor:
        if self.generator is None:
            return total
        if self.step.secure_mode or self.step.std == 0:
            return total.add_(_generate_noise(std=self.step.std, reference=total, generator=self.generator,
                                              secure_mode=self.step.secure_mode))
        buffer = self._buffer
        if buffer is None or buffer.dtype != total.dtype or buffer.device != total.device or \
                buffer.numel() < total.numel():
            size = max(s.numel() for s in self.step.sums)
            buffer = self._buffer = torch.empty(size, dtype=total.dtype, device=total.device)
        draw = buffer[:total.numel()].view(total.shape).normal_(0.0, self.step.std, generator=self.generator)
        return total.add_(draw)


@register_reduction("ddp")
def replicated(step: NoisySum) -> list[torch.Tensor]:
    """Noise on rank 0 (one draw for the whole step, from its secret stream), all-reduce SUM, divide by L."""
    generator = None
    if step.rank == 0 and step.noise_multiplier > 0:
        generator = step.noise_generator(step.params[0].device)
    out, noise = [], _NoiseDraws(step, generator)
    for total in step.sums:
        total = noise.add_to(total)
        if step.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        out.append(total.div_(step.expected_batch_size))
    return out


# ---- parameters sharded by FSDP2 ------------------------------------------------------------------------------
def own_rows(p: torch.nn.Parameter, clipped_sum: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter (SUM over the processes) a full-size clipped sum of the sharded p; this rank's rows of it."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = p.device_mesh
    partial = DTensor.from_local(clipped_sum, mesh, [Partial()] * mesh.ndim, shape=p.shape, stride=p.stride())
    return partial.redistribute(mesh, p.placements).to_local()


@register_reduction("fsdp2", fold=own_rows)
def sharded(step: NoisySum) -> list[torch.Tensor]:
    """Each rank noises the rows it owns (its shard's stream of the step's secret), divides by L; DTensor gradients."""
    from torch.distributed.tensor import DTensor

    generator = None
    if step.noise_multiplier > 0:
        generator = step.noise_generator(step.params[0].device, shard=step.rank)
    out, noise = [], _NoiseDraws(step, generator)
    for p, rows in zip(step.params, step.sums):
        if rows.numel():
            rows = noise.add_to(rows)
        out.append(DTensor.from_local(rows.div_(step.expected_batch_size), p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride()))
    return out
