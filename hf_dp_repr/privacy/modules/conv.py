"""2-D convolutions (a ViT's patch projection, CNNs). The per-sample rule is Opacus' own; the ghost rule works on
unfolded patches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ghost_rules import at_least_f32, register_ghost_rule


def patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Conv2d inputs unfolded to (B, C·kh·kw, L). A patch embedding (stride = kernel, no padding) is a reshape,
    where F.unfold (im2col) took a third of the norm time of a ViT on CPU."""
    (kh, kw), (h, w) = conv.kernel_size, x.shape[-2:]
    if (tuple(conv.stride) == (kh, kw) and tuple(conv.padding) == (0, 0) and tuple(conv.dilation) == (1, 1)
            and h % kh == 0 and w % kw == 0):
        b, c = x.shape[:2]
        x = x.reshape(b, c, h // kh, kh, w // kw, kw).permute(0, 1, 3, 5, 2, 4)
        return x.reshape(b, c * kh * kw, (h // kh) * (w // kw))
    return F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)


def _conv2d_unsupported(module) -> str | None:
    if module.groups != 1 or isinstance(module.padding, str) or module.padding_mode != "zeros":
        return "has groups, string padding or a non-zero padding mode"
    return None


@register_ghost_rule(nn.Conv2d, unsupported=_conv2d_unsupported)
def conv2d_pieces(module, inputs, grad, trained):
    """On unfolded patches: G = Σ_l g_l ⊗ patch_l."""
    a = patches(module, at_least_f32(inputs[0]))
    g = at_least_f32(grad).flatten(2)
    return [(module.weight, "factors", g.transpose(1, 2), a.transpose(1, 2))] + (
        [(module.bias, "explicit", g.sum(2))] if module.bias in trained else [])
