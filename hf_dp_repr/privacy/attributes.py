"""The attributes DP training attaches to parameters, in one list, and their clean-up.

Opacus' hooks set `grad_sample` and `_forward_counter`; Opacus' optimizer sets `summed_grad` (to None: the micro-batch
optimizer keeps its clipped sums off the parameters, `MicroBatchDPOptimizer._clipped_sums`); the trainer
names each parameter `_dp_name` for error messages. None of them may outlive training (a saved or merged copy
would carry per-example gradients or stale sums).

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.summed_grad = torch.ones(2); p._dp_name = "w"
    >>> clear_dp_attributes([p]); [hasattr(p, a) for a in PER_PARAMETER_ATTRIBUTES]
    [False, False, False, False]
"""

from __future__ import annotations

PER_PARAMETER_ATTRIBUTES = ("grad_sample", "summed_grad", "_forward_counter", "_dp_name")


def clear_dp_attributes(params) -> None:
    """Delete every attribute of `PER_PARAMETER_ATTRIBUTES` from each parameter of `params`."""
    for p in params:
        for attr in PER_PARAMETER_ATTRIBUTES:
            if hasattr(p, attr):
                delattr(p, attr)
