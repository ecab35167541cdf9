"""The ghost-norm rules: for each kind of module that owns a trained tensor, whether the ghost-clipping engine
(`ghost_clipping.py`) can clip it exactly and how its per-example gradient pieces are computed, in one entry.

A rule has a matcher (a module type: its instances and the subclasses that keep its `forward`, since a subclass with
its own forward, e.g. a scaled embedding, computes something else; or a predicate `module -> bool`, e.g. for HF's
RMSNorm classes), `pieces(module, inputs, grad, trained)` and optionally `unsupported(module) -> reason | None` (a
configuration of a matched module the rule cannot clip exactly) and `inputs(module, args, kwargs)` (what the
forward hook keeps, when not the positional arguments). Rules are tried in registration order, first match wins;
after them, Opacus' registered per-sample gradient rules (`GradSampleModule.GRAD_SAMPLERS`, exact type, including
ours from `grad_samplers.py`; an FSDP2-sharded `FSDP<Class>` by its own class, `sharding.base_type`). A module none
matches is not supported: `clipping_engine="auto"` falls back to Opacus hooks with the reason, `"ghost"` refuses.

`pieces` gets the module's inputs and the gradient of the loss with respect to its output, examples first, and
returns, for the tensors in `trained`, items `(param, "factors", L, R)` (the per-example gradient is
Σ_t L_it ⊗ R_it: L (B, T, p) or a `OneHot`, R (B, T, q); its norm is then computed without forming it) or
`(param, "explicit", G)` (G (B, ...): the per-example gradient itself, for small tensors).

Example (a rule for a new module type; its norms equal those of per-example gradients computed one by one):
    >>> import torch
    >>> from torch import nn
    >>> from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine, unsupported_reason
    >>> class Gain(nn.Module):  # y = x ⊙ s
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * self.s
    >>> model = nn.Sequential(nn.Linear(4, 4), Gain(4))
    >>> unsupported_reason(model)
    '1 (Gain) has trained parameters and no per-example rule'
    >>> @register_ghost_rule(Gain)
    ... def gain_pieces(module, inputs, grad, trained):  # ∂L/∂s of example i: Σ_t g_it ⊙ x_it
    ...     return [(module.s, "explicit", (rows(grad) * rows(inputs[0])).sum(1))]
    >>> unsupported_reason(model) is None
    True
    >>> engine, x = GhostClippingEngine(model), torch.randn(3, 5, 4)
    >>> with engine.recording():
    ...     model(x).pow(2).sum().backward()
    >>> norms = engine.squared_norms()[model[1].s]
    >>> brute = [torch.autograd.grad(model(x[i]).pow(2).sum(), model[1].s)[0].pow(2).sum() for i in range(3)]
    >>> torch.allclose(norms, torch.stack(brute))
    True
    >>> engine.remove()
    >>> del GHOST_RULES[Gain]  # registrations last for the process: this example removes its own
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn

from ..errors import NotPrivatizableError
from ..registry import Registry
from .sharding import base_type


def _supported(module: nn.Module) -> None:
    return None


def _positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    return args


@dataclass(frozen=True)
class GhostRule:
    matches: Callable[[nn.Module], bool]
    pieces: Callable[[nn.Module, tuple, torch.Tensor, set], list]
    unsupported: Callable[[nn.Module], str | None] = _supported
    inputs: Callable[[nn.Module, tuple, dict], tuple] = _positional


GHOST_RULES = Registry("ghost rule")  # match (a type or a predicate) -> GhostRule, in the order they are tried


def register_ghost_rule(match, *, unsupported=None, inputs=None, replace: bool = False):
    """Decorator: register `pieces(module, inputs, grad, trained)` for the modules `match` matches (a type, or a
    predicate on the module), after the rules registered before it; a second rule for the same `match` is refused
    unless `replace`."""
    matches = _same_forward(match) if isinstance(match, type) else match

    def register(pieces):
        GHOST_RULES.add(match, GhostRule(matches, pieces, unsupported or _supported, inputs or _positional),
                        replace=replace)
        return pieces

    return register


def _same_forward(cls: type) -> Callable[[nn.Module], bool]:
    return lambda module: isinstance(module, cls) and type(module).forward is cls.forward


def rule_for(module: nn.Module) -> GhostRule | None:
    """The first rule that matches `module`, else Opacus' registered rule for its exact type, else None."""
    for rule in GHOST_RULES.values():
        if rule.matches(module):
            return rule
    return OPACUS_RULE if base_type(module) in GradSampleModule.GRAD_SAMPLERS else None


def unsupported(module: nn.Module) -> str | None:
    """Why the engine cannot clip `module`'s trained tensors exactly (None when it can)."""
    rule = rule_for(module)
    return "has trained parameters and no per-example rule" if rule is None else rule.unsupported(module)


def saved_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What the engine keeps of one call of `module` for its rule."""
    rule = rule_for(module)
    return args if rule is None else rule.inputs(module, args, kwargs)


def pieces_of(module: nn.Module, inputs: tuple, grad: torch.Tensor, trained: set) -> list[tuple]:
    """One use of a module as (param, "factors", L, R) or (param, "explicit", per-example gradient) items, for
    the parameters in `trained` (while recording, they are all marked requires_grad=False)."""
    rule = rule_for(module)
    if rule is None:
        raise NotPrivatizableError(f"GhostClippingEngine: {type(module).__name__} has trained parameters and no "
                                   "per-example rule; register one (privacy.ghost_rules.register_ghost_rule) or use "
                                   "clipping_engine='hooks'.")
    return [item for item in rule.pieces(module, inputs, grad, trained) if item[0] in trained]


# ---- what rules work with -----------------------------------------------------------------------------------
def at_least_f32(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 norms drift; float64 stays float64 for exact tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rows(t: torch.Tensor) -> torch.Tensor:
    """(B, ..., d) → (B, T, d) in at least float32, with T = 1 for a (B, d) tensor."""
    t = at_least_f32(t)
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(t.shape[0], -1, t.shape[-1])


class OneHot:
    """L of an embedding use: one-hot rows given by token ids (B, T), never expanded."""

    def __init__(self, ids: torch.Tensor, rows: int):
        self.ids, self.rows = ids.reshape(ids.shape[0], -1), rows


def opacus_pieces(module, inputs, grad, trained):
    """Small tensors (LayerNorm, ViT's embeddings ...): Opacus' registered rule for the module's exact type."""
    rule = GradSampleModule.GRAD_SAMPLERS[base_type(module)]
    own = {p: p.requires_grad for p in module.parameters(recurse=False) if p in trained}
    try:  # the rules skip tensors with requires_grad=False: mark this module's trained ones for the call
        for p in own:
            p.requires_grad_(True)
        per_example = rule(module, list(inputs), grad)
    finally:
        for p, flag in own.items():
            p.requires_grad_(flag)
    return [(p, "explicit", at_least_f32(gs)) for p, gs in per_example.items()]


OPACUS_RULE = GhostRule(lambda module: base_type(module) in GradSampleModule.GRAD_SAMPLERS, opacus_pieces)
