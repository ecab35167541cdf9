"""Linear layers: `nn.Linear` and transformers' `Conv1D` (GPT-2's linear layer, weight stored (in, out))."""

from __future__ import annotations

import torch
from opacus.grad_sample.linear import compute_linear_grad_sample
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..ghost_rules import register_ghost_rule, rows
from ..grad_samplers import examples_first, register_per_sample_rule

# ---- per-sample rules (Opacus' hooks) ----------------------------------------------------------------------------
register_per_sample_rule(nn.Linear)(examples_first(compute_linear_grad_sample))


@register_per_sample_rule(Conv1D)
@examples_first
def conv1d_grad_sample(layer: Conv1D, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """GPT-2's Conv1D is a linear layer y = x·W + b with W stored as (in, out)."""
    x = activations[0]
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = torch.einsum("n...i,n...j->nij", x, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = torch.einsum("n...k->nk", backprops)
    return grads


# ---- ghost rules (the ghost-norm engine) -------------------------------------------------------------------------
@register_ghost_rule(nn.Linear)
def linear_pieces(module, inputs, grad, trained):
    """y = x Wᵀ + b: G = Σ_t g_t ⊗ a_t."""
    a, g = rows(inputs[0]), rows(grad)
    return [(module.weight, "factors", g, a)] + ([(module.bias, "explicit", g.sum(1))] if module.bias in trained
                                                  else [])


@register_ghost_rule(Conv1D)
def conv1d_pieces(module, inputs, grad, trained):
    """transformers' Conv1D, y = x W + b with W stored (in, out): G = Σ_t a_t ⊗ g_t."""
    a, g = rows(inputs[0]), rows(grad)
    return [(module.weight, "factors", a, g)] + ([(module.bias, "explicit", g.sum(1))] if module.bias in trained
                                                  else [])
