"""Per-example losses. DP-SGD clips each example's gradient, so each example's loss must depend on that
example alone: token losses are averaged over the example's own tokens, never over the batch (a batch-wide
token mean would let one example's length change every other example's gradient)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from ..errors import DPConfigError


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, shift_labels: bool = False,
                     label_smoothing: float = 0.0) -> torch.Tensor:
    """Loss of each example, shape (batch,). Handles the label layouts of HF heads:

    - token labels (batch, T) with logits (batch, T, V): cross-entropy averaged over the example's tokens
      whose label is not -100; `shift_labels=True` for causal LMs (position t predicts label t+1);
    - class ids (batch,): cross-entropy;  - float (batch,) with one logit: squared error (regression);
    - float (batch, K) multi-hot: binary cross-entropy averaged over the K labels.

    `label_smoothing` ε (the Trainer's `label_smoothing_factor`, for class and token labels): (1-ε)·NLL + ε·the
    mean over classes of -log p, per token, as the Trainer's `LabelSmoother` computes it on one example.
    """
    if labels.dim() >= 2 and logits.dim() == labels.dim() + 1:
        if shift_labels:
            logits, labels = logits[:, :-1], labels[:, 1:]
        token_loss = F.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="none",
            label_smoothing=label_smoothing,
        ).view(labels.shape)
        n_tokens = (labels != -100).flatten(1).sum(1).clamp(min=1)
        return token_loss.flatten(1).sum(1) / n_tokens
    if labels.is_floating_point():
        if label_smoothing:
            raise DPConfigError(f"DPTrainer: label_smoothing_factor={label_smoothing} applies to class labels; these "
                                "labels are floats (regression or multi-label). Set label_smoothing_factor=0.")
        if logits.shape[-1] == 1 and labels.dim() == 1:
            return (logits.squeeze(-1).float() - labels.float()) ** 2
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").flatten(1).mean(1)
    return F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=label_smoothing)


def is_causal_lm(model) -> bool:
    """Causal LMs predict token t+1 at position t, so their labels are shifted (HF's ForCausalLMLoss)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    is_decoder_only = not getattr(getattr(base, "config", None), "is_encoder_decoder", False)
    return getattr(base, "loss_function", None) is ForCausalLMLoss and is_decoder_only
