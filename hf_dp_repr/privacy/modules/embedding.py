"""Embeddings: `nn.Embedding` (with PyTorch's `padding_idx`), OPT's learned positions (called with the attention
mask, the ids as a keyword) and ViT's embeddings (bare `cls_token` and `position_embeddings`, interpolated to the
image's size or not; their patch projection is a Conv2d, `conv.py`; the ghost engine clips them with the per-sample
rule below, `ghost_rules.OPACUS_RULE`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from torch import nn
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.vit.modeling_vit import ViTEmbeddings

from ...errors import NotPrivatizableError
from ..ghost_rules import OneHot, register_ghost_rule, rows
from ..grad_samplers import examples_first, register_per_sample_rule


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


# ---- per-sample rules (Opacus' hooks) ----------------------------------------------------------------------------
@register_per_sample_rule(nn.Embedding)
@examples_first
def embedding_grad_sample(layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Opacus' rule, with PyTorch's `padding_idx` (that row gets no gradient; Opacus gave it one)."""
    ids = activations[0]
    if layer.padding_idx is not None:
        backprops = backprops * (ids != layer.padding_idx).unsqueeze(-1).to(backprops.dtype)
    return compute_embedding_grad_sample(layer, [ids], backprops)


@register_per_sample_rule(OPTLearnedPositionalEmbedding)
def opt_positions_grad_sample(layer: OPTLearnedPositionalEmbedding, activations: list[torch.Tensor],
                              backprops: torch.Tensor) -> dict:
    """The embedding rule on the ids looked up (the third input, after `opt_positions_pre_hook`)."""
    return embedding_grad_sample(layer, [activations[2] + layer.offset], backprops)


@register_per_sample_rule(ViTEmbeddings)
def vit_embeddings_grad_sample(layer: ViTEmbeddings, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """ViT's bare `cls_token` and `position_embeddings` are added to the output, so their per-sample
    gradients are slices of `backprops`. The patch projection (a Conv2d child) has its own rule."""
    if layer.training and layer.dropout.p > 0:
        raise NotPrivatizableError(
            "ViTEmbeddings: per-sample gradients of cls_token/position_embeddings are only exact without "
            "embedding dropout; set config.hidden_dropout_prob=0 (the usual DP setting)."
        )
    grads = {}
    if layer.cls_token.requires_grad:
        grads[layer.cls_token] = backprops[:, None, :1]
    if layer.position_embeddings.requires_grad:
        grads[layer.position_embeddings] = vit_position_grads(layer, activations[0], backprops)[:, None]
    return grads


def vit_position_grads(layer: ViTEmbeddings, pixels: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Each example's gradient of `position_embeddings` (B, positions, D), given the gradient of the embeddings'
    output `backprops` (B, tokens, D). At the config's image size the positions are added as they are: the gradient
    is `backprops`. At another size the forward added `layer.interpolate_pos_encoding(...)`, a linear map of the
    position embeddings that acts on each of the D channels alike: its adjoint is taken by autograd through that very
    method, run once on B·D channels (example b's channel d at b·D + d)."""
    if tuple(pixels.shape[-2:]) == tuple(layer.image_size):
        return backprops
    batch, tokens, dim = backprops.shape
    with torch.enable_grad():
        positions = torch.zeros(1, layer.position_embeddings.shape[1], batch * dim, dtype=backprops.dtype,
                                device=backprops.device, requires_grad=True)
        stand_in = SimpleNamespace(position_embeddings=positions, patch_size=layer.patch_size)
        out = type(layer).interpolate_pos_encoding(stand_in, backprops.new_empty(1, tokens, batch * dim),
                                                   *pixels.shape[-2:])
        (grad,) = torch.autograd.grad(out, positions, backprops.permute(1, 0, 2).reshape(1, tokens, batch * dim))
    return grad.reshape(-1, batch, dim).permute(1, 0, 2)


# ---- ghost rules (the ghost-norm engine) -------------------------------------------------------------------------
def _embedding_unsupported(module) -> str | None:
    return "uses max_norm or sparse gradients" if module.max_norm is not None or module.sparse else None


def embedding_pieces(module, inputs, grad, trained):
    """inputs[0]: the ids looked up; G = Σ_t onehot(id_t) ⊗ g_t."""
    g, ids = rows(grad), inputs[0]
    if module.padding_idx is not None:  # PyTorch gives the padding row no gradient
        g = g * (ids.reshape(g.shape[0], -1, 1) != module.padding_idx)
    return [(module.weight, "factors", OneHot(ids, module.num_embeddings), g)]


register_ghost_rule(nn.Embedding, unsupported=_embedding_unsupported)(embedding_pieces)
# OPT's learned positions: an embedding called with the attention mask; the position ids are a keyword
register_ghost_rule(OPTLearnedPositionalEmbedding, unsupported=_embedding_unsupported,
                    inputs=lambda module, args, kwargs: (opt_position_ids(module, args, kwargs),))(embedding_pieces)
