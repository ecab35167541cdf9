"""Normalisation layers: `nn.LayerNorm` (per-sample rule; the ghost engine uses it too, `ghost_rules.OPACUS_RULE`)
and HF's RMSNorm classes (Llama, Mistral, Qwen, T5's T5LayerNorm; a ghost rule, matched by a predicate since each
model defines its own class)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ghost_rules import at_least_f32, register_ghost_rule, rows
from ..grad_samplers import examples_first, register_per_sample_rule


@register_per_sample_rule(nn.LayerNorm)
@examples_first
def layer_norm_grad_sample(layer: nn.LayerNorm, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Opacus' rule, also for LayerNorm(bias=False) (Opacus reads `layer.bias.requires_grad` and crashes)."""
    x = activations[0]
    grads = {}
    dims = list(range(1, x.dim() - len(layer.normalized_shape)))  # all but the batch and the normalised ones
    if layer.weight is not None and layer.weight.requires_grad:
        normed = F.layer_norm(x, layer.normalized_shape, eps=layer.eps)
        grads[layer.weight] = (normed * backprops).sum(dims) if dims else normed * backprops
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = backprops.sum(dims) if dims else backprops
    return grads


def is_rms_norm(module: nn.Module) -> bool:
    """HF's RMSNorm modules (Llama, Mistral, Qwen, T5's T5LayerNorm ...): y = weight · x / rms(x), one scale."""
    return (type(module).__name__.endswith(("RMSNorm", "T5LayerNorm"))
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and hasattr(module, "variance_epsilon") and len(list(module.parameters(recurse=False))) == 1)


@register_ghost_rule(is_rms_norm)
def rms_norm_pieces(module, inputs, grad, trained):
    x = at_least_f32(inputs[0])
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(inputs[0].dtype)
    return [(module.weight, "explicit", (rows(grad) * rows(normed)).sum(1))]
