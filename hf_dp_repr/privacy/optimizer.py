"""Opacus DP optimizers adapted to the Trainer's gradient accumulation.

Opacus' optimizers clip and noise in one `step()`. Under gradient accumulation that would keep the
per-sample gradients of a whole logical batch in memory. Here each micro-batch is clipped right after its
backward (`accumulate_micro_batch`), the clipped sum is kept, and `step()` adds the Gaussian noise once per
logical batch, on rank 0 only, sums over processes and divides by the expected global batch size:

    update = (Σ_i clip_C(g_i) + N(0, σ²C²)) / L,    L = per_device_batch × accumulation × processes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

AUTOMATIC_CLIPPING_GAMMA = 0.01  # stability constant γ of Bu et al. (2023), "Automatic clipping"


class _MicroBatchDP:
    """Mixin over an Opacus DPOptimizer: clip per micro-batch, noise once per logical step."""

    def __init__(self, *args, world_size: int = 1, rank: int = 0, **kwargs):
        super().__init__(*args, loss_reduction="mean", **kwargs)
        self.world_size = world_size
        self.rank = rank

    def accumulate_micro_batch(self) -> None:
        """Clip the per-sample gradients of the micro-batch just back-propagated, add them to the clipped sum
        and free them. A no-op after an empty micro-batch."""
        missing = [p for p in self.params if getattr(p, "grad_sample", None) is None]
        if len(missing) == len(self.params):
            return
        if missing:
            names = ", ".join(getattr(p, "_dp_name", str(tuple(p.shape))) for p in missing)
            raise RuntimeError(
                f"These trainable parameters got no per-sample gradient in the forward pass: {names}. They are "
                "unused by the model's forward; freeze them (requires_grad=False) so DP-SGD does not train them."
            )
        self.clip_and_accumulate()
        for p in self.params:
            # The summed, unclipped gradient is not private: drop it so nothing can read or log it.
            p.grad_sample = None
            p.grad = None

    def pre_step(self, closure=None) -> bool:
        self.accumulate_micro_batch()
        for p in self.params:
            if p.summed_grad is None:  # the whole logical batch was empty: the update is pure noise
                p.summed_grad = torch.zeros_like(p)
        if self.rank == 0:
            self.add_noise()
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p).clone()
        if self.world_size > 1:
            for p in self.params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        for p in self.params:
            p.grad /= self.expected_batch_size
            p.summed_grad = None
        if self.step_hook:
            self.step_hook(self)
        return True


class MicroBatchDPOptimizer(_MicroBatchDP, DPOptimizer):
    """Flat clipping: each example's whole gradient is clipped to norm C."""


class MicroBatchPerLayerDPOptimizer(_MicroBatchDP, DPPerLayerOptimizer):
    """Per-layer clipping: each parameter tensor's per-example gradient is clipped separately."""


class MicroBatchAutomaticDPOptimizer(_MicroBatchDP, DPOptimizer):
    """Automatic clipping (Bu et al.): g_i · C / (||g_i|| + γ). Every example contributes norm < C, so the
    sensitivity, and the noise calibration, are those of flat clipping at C."""

    def clip_and_accumulate(self) -> None:
        grad_samples = self.grad_samples
        norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grad_samples], dim=1).norm(2, dim=1)
        factor = self.max_grad_norm / (norms + AUTOMATIC_CLIPPING_GAMMA)
        for p, g in zip(self.params, grad_samples):
            clipped = torch.einsum("i,i...", factor.to(g.dtype), g).to(p.dtype)
            p.summed_grad = clipped if p.summed_grad is None else p.summed_grad + clipped


def make_dp_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    clipping: str,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    world_size: int = 1,
    rank: int = 0,
    secure_mode: bool = False,
) -> _MicroBatchDP:
    """Wrap `optimizer` for DP-SGD with the given clipping mode ("flat", "per_layer", "automatic")."""
    common = dict(
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        secure_mode=secure_mode,
        world_size=world_size,
        rank=rank,
    )
    if clipping == "per_layer":
        # Equal split of the budget C over the parameter tensors keeps the total sensitivity at C.
        n_tensors = sum(len([p for p in g["params"] if p.requires_grad]) for g in optimizer.param_groups)
        per_tensor = [max_grad_norm / math.sqrt(n_tensors)] * n_tensors
        return MicroBatchPerLayerDPOptimizer(optimizer, max_grad_norm=per_tensor, **common)
    cls = MicroBatchAutomaticDPOptimizer if clipping == "automatic" else MicroBatchDPOptimizer
    return cls(optimizer, max_grad_norm=max_grad_norm, **common)
