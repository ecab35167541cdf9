"""The scope of each phase of a run: what trains in a linear-probing phase, then in the fine-tuning phase, from
`trainable_blocks` (`blocks`) or `trainable_groups` (`groups`), which it chooses between.

Example:
    >>> from hf_dp_repr.scope.phases import phase_scopes
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> [s.description for s in phase_scopes(tiny_vit(), trainable_blocks=1, lp_steps=2)]
    ['linear probe: head (classifier)', 'last 1 of 4 blocks (vit.layers.3) + vit.layernorm + head (classifier)']
"""

from __future__ import annotations

from torch import nn

from ..errors import ScopeError
from .blocks import Scope, select_scope
from .groups import select_groups


def phase_scopes(model: nn.Module, trainable_blocks: int | None, lp_steps: float,
                 block_stack: str | None = None, trainable_groups=None) -> list[Scope]:
    """The scope of each phase of a run: [] (train what requires grad), [scope], or [head, scope] when a
    linear-probing phase (`lp_steps`) comes first. `trainable_groups` (blocks and named groups, see
    `groups`) replaces `trainable_blocks` when given."""
    if trainable_groups is not None:
        if trainable_blocks is not None:
            raise ScopeError("trainable_blocks and trainable_groups are both set; give one (e.g. trainable_groups="
                             "'last:2,norms,head' for the last 2 blocks plus every norm and the head).")
        last = select_groups(model, trainable_groups, block_stack)
        return [select_scope(model, 0), last] if lp_steps else [last]
    if trainable_blocks is None and not lp_steps:
        return []
    if trainable_blocks is None:
        last = Scope([p for p in model.parameters() if p.requires_grad], "all parameters", frozen_prefix=False)
    else:
        last = select_scope(model, trainable_blocks, block_stack)
    return [select_scope(model, 0), last] if lp_steps else [last]
