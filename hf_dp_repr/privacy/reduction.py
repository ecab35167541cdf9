"""How the clipped sums of one logical step become the released gradient: summed over the processes, noised
once, divided by the expected batch. A registry of strategies; `EngineOptions.reduction` picks one.

"ddp" (every process holds every parameter whole: one process, or DDP): rank 0 adds N(0, σ²C²) to its clipped
sum of each tensor, the sums are all-reduced and divided by the expected global batch L:

    grad = (Σ_ranks Σ_i clip_C(g_i) + N(0, σ²C²)) / L.

Parameters sharded over the processes (FSDP2) need a sibling: reduce-scatter the sums, and each rank noises only
the coordinates it owns, with `step.noise_generator(device, shard)` (a stream of the run's secret per step and
shard). It is one registration; neither the engine nor the trainer changes.

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

from ..errors import ArgumentError


@dataclass(frozen=True)
class NoisySum:
    """One logical step's inputs to a reduction strategy (this process's view)."""

    params: list[torch.nn.Parameter]
    sums: list[torch.Tensor]  # this process's clipped sum of each parameter, float32, in `params` order
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
REDUCTIONS: dict[str, Reduction] = {}


def register_reduction(name: str) -> Callable[[Reduction], Reduction]:
    """Register a strategy under `name` (see the module docstring)."""
    def register(strategy: Reduction) -> Reduction:
        if name in REDUCTIONS:
            raise ArgumentError(f"reduction {name!r} is already registered.")
        REDUCTIONS[name] = strategy
        return strategy
    return register


def reduction(name: str) -> Reduction:
    if name not in REDUCTIONS:
        raise ArgumentError(f"unknown reduction {name!r}; use one of {tuple(REDUCTIONS)}.")
    return REDUCTIONS[name]


@register_reduction("ddp")
def replicated(step: NoisySum) -> list[torch.Tensor]:
    """Noise on rank 0 (one draw for the whole step, from its secret stream), all-reduce SUM, divide by L."""
    generator = None
    if step.rank == 0 and step.noise_multiplier > 0:
        generator = step.noise_generator(step.params[0].device)
    out = []
    for total in step.sums:
        if generator is not None:
            total = total + _generate_noise(std=step.std, reference=total, generator=generator,
                                            secure_mode=step.secure_mode)
        if step.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        out.append(total / step.expected_batch_size)
    return out
