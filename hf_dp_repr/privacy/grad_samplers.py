"""Per-sample gradient rules for Hugging Face modules that Opacus has none for (Conv1D, ViT's embeddings, OPT's
learned positions), Opacus' own rules where they fall short (LayerNorm(bias=False) crashed; Embedding gave the
`padding_idx` row a gradient; none summed several rows per example: `examples_first`), and
`register_grad_samplers()`, which puts them into Opacus' own registry (`opacus.grad_sample.register_grad_sampler`).
It runs as this module loads (as Opacus' own `@register_grad_sampler` rules do); every module that hooks a model
with Opacus (`clippers`, `ghost_rules`) imports this one, so the rules are in place first, and the torch-free
parts of `privacy` (the accountants) do not load it.

Without them Opacus falls back to functorch, which re-runs each module per example: correct but slow.
Each rule receives the module's inputs (`activations`) and the gradient of the loss with respect to its
output (`backprops`), both with the batch first, and returns {parameter: per-sample gradient}.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from opacus.grad_sample import register_grad_sampler
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from opacus.grad_sample.linear import compute_linear_grad_sample
from torch import nn
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.vit.modeling_vit import ViTEmbeddings
from transformers.pytorch_utils import Conv1D

from ..errors import NotPrivatizableError


def examples_first(rule):
    """A rule for modules that may see several rows per example: OPT's MLP and its LayerNorm see (B·T, d). For
    them `ExampleRows` (privacy/batch_rows.py) sets Opacus' `max_batch_len` to the number of examples B (Opacus'
    own mechanism for packed sequences); the rows, example-major (checked at the start of training), are then
    viewed as (B, T, ...) and each example's gradient sums over its rows."""
    def per_example(layer, activations, backprops):
        n = getattr(layer, "max_batch_len", backprops.shape[0])
        if backprops.shape[0] != n:
            activations = [a.reshape(n, -1, *a.shape[1:]) for a in activations]
            backprops = backprops.reshape(n, -1, *backprops.shape[1:])
        return rule(layer, activations, backprops)

    per_example.__name__ = per_example.__qualname__ = f"examples_first_{rule.__name__}"
    return per_example


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


def vit_embeddings_grad_sample(layer: ViTEmbeddings, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """ViT's bare `cls_token` and `position_embeddings` are added to the output, so their per-sample
    gradients are slices of `backprops`. The patch projection (a Conv2d child) has its own Opacus rule."""
    if layer.training and layer.dropout.p > 0:
        raise NotPrivatizableError(
            "ViTEmbeddings: per-sample gradients of cls_token/position_embeddings are only exact without "
            "embedding dropout; set config.hidden_dropout_prob=0 (the usual DP setting)."
        )
    if backprops.shape[1] != layer.position_embeddings.shape[1]:
        raise NotPrivatizableError(
            "ViTEmbeddings: interpolate_pos_encoding is not supported under DP; feed images of the "
            f"model's size {tuple(layer.image_size)}."
        )
    grads = {}
    if layer.cls_token.requires_grad:
        grads[layer.cls_token] = backprops[:, None, :1]
    if layer.position_embeddings.requires_grad:
        grads[layer.position_embeddings] = backprops[:, None]
    return grads


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


@examples_first
def embedding_grad_sample(layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Opacus' rule, with PyTorch's `padding_idx` (that row gets no gradient; Opacus gave it one)."""
    ids = activations[0]
    if layer.padding_idx is not None:
        backprops = backprops * (ids != layer.padding_idx).unsqueeze(-1).to(backprops.dtype)
    return compute_embedding_grad_sample(layer, [ids], backprops)


def opt_position_ids(module: OPTLearnedPositionalEmbedding, args: tuple, kwargs: dict) -> torch.Tensor:
    """The rows OPT's learned position embedding looks up: `position_ids + offset`. Its forward takes the attention
    mask first and the ids as a keyword (OPT's decoder always passes them); without them it would rebuild them
    from the mask, which the per-example rules do not repeat."""
    ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if ids is None:
        raise NotPrivatizableError(f"{type(module).__name__} was called without position_ids; per-example gradients "
                                   "need the ids it looks up. Fix: pass position_ids (OPT's decoder does).")
    return ids + module.offset


def opt_positions_pre_hook(module: OPTLearnedPositionalEmbedding, args: tuple, kwargs: dict):
    """For Opacus' hooks, which keep a module's positional inputs (and crash on OPT's int `cache_length`): the call
    becomes (mask, cache_length as a tensor, position_ids), all positional, so the rule below sees the ids."""
    ids = opt_position_ids(module, args, kwargs) - module.offset
    cache = kwargs.get("cache_length", args[1] if len(args) > 1 else 0)
    return (args[0], torch.as_tensor(cache), ids), {}


def opt_positions_grad_sample(layer: OPTLearnedPositionalEmbedding, activations: list[torch.Tensor],
                              backprops: torch.Tensor) -> dict:
    """The embedding rule on the ids looked up (the third input, after `opt_positions_pre_hook`)."""
    return embedding_grad_sample(layer, [activations[2] + layer.offset], backprops)


linear_grad_sample = examples_first(compute_linear_grad_sample)

# Module class → its rule; `register_grad_samplers` installs exactly these.
HF_GRAD_SAMPLERS = {Conv1D: conv1d_grad_sample, ViTEmbeddings: vit_embeddings_grad_sample,
                    nn.Linear: linear_grad_sample, nn.LayerNorm: layer_norm_grad_sample,
                    nn.Embedding: embedding_grad_sample, OPTLearnedPositionalEmbedding: opt_positions_grad_sample}


def register_grad_samplers() -> None:
    """Register `HF_GRAD_SAMPLERS` into Opacus (the hooks and the fast-clipping hooks). Idempotent: each call
    sets the same registry entries again."""
    for module_class, rule in HF_GRAD_SAMPLERS.items():
        register_grad_sampler(module_class)(rule)


def batch_position_ids(model, inputs: dict) -> None:
    """Give `position_ids` a real batch dimension. HF models build them with batch 1, which gives the position
    embedding a per-sample gradient of batch 1 (Opacus then crashes on GPT-2 and BERT)."""
    ids = inputs.get("input_ids")
    if ids is None or "position_ids" in inputs or "position_ids" not in inspect.signature(model.forward).parameters:
        return
    inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


register_grad_samplers()  # as this module loads: see the docstring
