"""Whole values of parameters that may be FSDP2 shards (DTensors), for the code that edits weights outside the
optimizer (the public preconditioning of a probe's head, the weight average's checkpoints).

Both functions are collectives for a DTensor: every rank calls them, in the same order. A plain tensor is left to
the caller's process.

Example:
    >>> import torch
    >>> from hf_dp_repr.scope.shards import assign, whole
    >>> p = torch.nn.Parameter(torch.zeros(2, 3))
    >>> assign(p, torch.ones(2, 2))  # a plain parameter may change shape
    >>> whole(p).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import torch


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t`'s whole value, detached (gathered on every rank when it is a DTensor)."""
    return t.full_tensor().detach() if is_dtensor(t) else t.detach()


@torch.no_grad()
def assign(p: torch.Tensor, value: torch.Tensor) -> None:
    """Make `value` (whole, or a DTensor laid out as `p`) the value of the parameter `p`, in place. A DTensor keeps its
    shape, mesh and placements (FSDP2 fixes them when it shards: rank 0's `value` is scattered); a plain parameter
    takes `value`'s shape."""
    if not is_dtensor(p):
        if p.shape == value.shape:
            p.copy_(value)
        else:
            p.data = value.to(p.device, p.dtype)
        return
    if not is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
    p.copy_(value)
