"""Per-sample gradient rules for Hugging Face modules that Opacus has none for, and `register_grad_samplers()`,
which puts them into Opacus' own registry (`opacus.grad_sample.register_grad_sampler`). It is called once, from
`hf_dp_repr/privacy/__init__.py`: importing anything of the package registers them, and no module imports this
one for a side effect.

Without them Opacus falls back to functorch, which re-runs each module per example: correct but slow.
Each rule receives the module's inputs (`activations`) and the gradient of the loss with respect to its
output (`backprops`), both with the batch first, and returns {parameter: per-sample gradient}.
"""

from __future__ import annotations

import inspect

import torch
from opacus.grad_sample import register_grad_sampler
from transformers.models.vit.modeling_vit import ViTEmbeddings
from transformers.pytorch_utils import Conv1D


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
        raise ValueError(
            "ViTEmbeddings: per-sample gradients of cls_token/position_embeddings are only exact without "
            "embedding dropout; set config.hidden_dropout_prob=0 (the usual DP setting)."
        )
    if backprops.shape[1] != layer.position_embeddings.shape[1]:
        raise ValueError(
            "ViTEmbeddings: interpolate_pos_encoding is not supported under DP; feed images of the "
            f"model's size {tuple(layer.image_size)}."
        )
    grads = {}
    if layer.cls_token.requires_grad:
        grads[layer.cls_token] = backprops[:, None, :1]
    if layer.position_embeddings.requires_grad:
        grads[layer.position_embeddings] = backprops[:, None]
    return grads


# Module class → its rule; `register_grad_samplers` installs exactly these.
HF_GRAD_SAMPLERS = {Conv1D: conv1d_grad_sample, ViTEmbeddings: vit_embeddings_grad_sample}


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
