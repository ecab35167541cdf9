"""Per-example clipping modes (a registry, as Opacus' `GRAD_SAMPLERS`): how each example's gradient is scaled
before the clipped sum.

A mode maps the per-example, per-tensor gradient norms (float32, shape (examples, tensors)) and the bound C to the
factors (same shape) that each example's tensors are multiplied by. A *private* mode must bound every example's
scaled gradient by C in L2 norm, the sensitivity the noise is calibrated to (tests/test_clipping_modes.py checks
every registered private mode). A mode registered with `private=False` (the reference "none") is refused unless
σ = 0 and no target ε is set (`DPTrainingArguments`). The arguments accept exactly the registered names.

Example (a new mode is one registration; `DPTrainingArguments(clipping="half_flat")` then accepts it):
    >>> import torch
    >>> from hf_dp_repr.privacy.clipping_modes import CLIPPING_MODES, clip_factors, register_clipping_mode
    >>> @register_clipping_mode("half_flat", help="flat clipping to C/2")
    ... def half_flat(norms, max_grad_norm):
    ...     total = norms.norm(2, dim=1, keepdim=True)
    ...     return (max_grad_norm / 2 / (total + 1e-6)).clamp(max=1.0).expand_as(norms)
    >>> clip_factors("half_flat", torch.tensor([[3.0, 4.0]]), 1.0)  # ||(3, 4)|| = 5 → scaled to 0.5
    tensor([[0.1000, 0.1000]])
    >>> del CLIPPING_MODES["half_flat"]  # (the example leaves the registry as it found it)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry

AUTOMATIC_CLIPPING_GAMMA = 0.01  # stability constant γ of Bu et al. (2023), "Automatic clipping"

Factors = Callable[[torch.Tensor, float], torch.Tensor]  # (norms (B, T) float32, C) -> factors (B, T)


@dataclass(frozen=True)
class ClippingMode:
    name: str
    factors: Factors
    private: bool = True  # bounds each example's contribution by C; False: the non-private reference only (σ = 0)
    help: str = ""


CLIPPING_MODES = Registry("clipping mode")  # in registration order: the order the arguments list them


def register_clipping_mode(name: str, *, private: bool = True, help: str = "", replace: bool = False
                           ) -> Callable[[Factors], Factors]:
    """Register `factors(norms, max_grad_norm) -> factors` as clipping mode `name` (see the module docstring)."""
    def register(factors: Factors) -> Factors:
        CLIPPING_MODES.add(name, ClippingMode(name, factors, private, help), replace=replace)
        return factors
    return register


def clipping_mode(name: str) -> ClippingMode:
    return CLIPPING_MODES.lookup(name)


def clip_factors(name: str, norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Per-example, per-tensor factors (batch, tensors) of mode `name` from float32 norms of the same shape."""
    return clipping_mode(name).factors(norms, max_grad_norm)


@register_clipping_mode("flat", help="each example's whole gradient to norm C")
def flat(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    total = norms.norm(2, dim=1, keepdim=True)
    return (max_grad_norm / (total + 1e-6)).clamp(max=1.0).expand_as(norms)


@register_clipping_mode("per_layer", help="each parameter tensor to C/sqrt(#tensors), total sensitivity C")
def per_layer(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    per_tensor = max_grad_norm / math.sqrt(norms.shape[1])
    return (per_tensor / (norms + 1e-6)).clamp(max=1.0)


@register_clipping_mode("automatic", help="Bu et al.: g·C/(||g|| + 0.01), norm < C")
def automatic(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    total = norms.norm(2, dim=1, keepdim=True)
    return (max_grad_norm / (total + AUTOMATIC_CLIPPING_GAMMA)).expand_as(norms)


@register_clipping_mode("none", private=False, help="the unclipped reference: the plain mean gradient (σ = 0 only)")
def no_clipping(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    return torch.ones_like(norms)
