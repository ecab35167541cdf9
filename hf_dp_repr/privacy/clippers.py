"""Per-example clipping machinery on a model (a registry): the ghost-norm engine, or Opacus' per-sample hooks.

Both clip the same way and give the same guarantee; they differ in speed and memory. A clipper is attached to the
model being trained and has one small interface: `recording(n)` around a micro-batch of n examples (forward and
backward), `remove()`, `disable_hooks()`/`enable_hooks()` (a public-data computation in between, e.g. the
curvature), `ghost` (a `GhostClippingEngine` giving norms and clipped sums to the optimizer, or None: per-sample
gradients in `p.grad_sample`) and, on the class, `unsupported(model, plan)`: why it cannot clip this model exactly
(None when it can); one that can clip a model sharded by FSDP2 takes `key_of` (`sharding.parameter_keys`).
`choose_clipper` tries them in registration order for clipping_engine="auto".

Example (a new clipper is one registration; `choose_clipper` then considers it, after those registered before):
    >>> from hf_dp_repr.privacy.clippers import CLIPPERS, HooksClipper, register_clipper
    >>> @register_clipper("hooks_logged")
    ... class LoggedHooks(HooksClipper):
    ...     how = "by Opacus hooks, logged"
    >>> list(CLIPPERS)
    ['ghost', 'hooks', 'hooks_logged']
    >>> del CLIPPERS["hooks_logged"]
"""

from __future__ import annotations

import contextlib

from opacus.grad_sample import GradSampleHooks
from torch import nn
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from ..errors import DPConfigError
from ..registry import Registry
from . import modules  # noqa: F401 (every family's rules, installed into Opacus, before a model is hooked)
from .batch_rows import ExampleRows
from .ghost_clipping import GhostClippingEngine, unsupported_reason
from .ledger import PrivacyPlan
from .modules.embedding import opt_positions_pre_hook
from .sharding import is_sharded
from .units import ROW

CLIPPERS = Registry("clipper")  # name -> clipper class, in order of preference


def register_clipper(name: str, *, replace: bool = False):
    """Class decorator: register a clipper under `name` (see the module docstring)."""
    def register(cls):
        CLIPPERS.add(name, cls, replace=replace)
        cls.name = name
        return cls
    return register


class _Clipper:
    name = ""
    how = ""  # the INFO line: "per-example clipping {how}"
    label = ""  # the fallback warning: "falls back to {label}"
    ghost: GhostClippingEngine | None = None

    def __init__(self, model: nn.Module, several=()):
        # every hooked module's rows checked against the micro-batch's examples
        self.rows = ExampleRows(model, several, opacus=self.ghost is None)

    @staticmethod
    def unsupported(model: nn.Module, plan: PrivacyPlan) -> str | None:
        return None

    def recording(self, batch_size: int):
        """Around one micro-batch's forward and backward (batch_size examples)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.rows.expect(batch_size))
        if self.ghost is not None:
            stack.enter_context(self.ghost.recording(batch_size))
        return stack

    def disable_hooks(self) -> None:
        pass

    def enable_hooks(self) -> None:
        pass

    def remove(self) -> None:
        self.rows.remove()


@register_clipper("ghost")
class GhostClipper(_Clipper):
    """Ghost norms and book-keeping (`privacy.ghost_clipping`): no per-example gradient held for large tensors.
    Its hooks record only inside `recording`, so disabling them is a no-op."""

    how = "by ghost norms and book-keeping"
    label = "the ghost-norm engine"

    def __init__(self, model: nn.Module, several=(), key_of=None):
        # only modules that own a trained tensor are hooked (nothing below the scope)
        self.ghost = GhostClippingEngine(model, several=several, key_of=key_of)
        super().__init__(model, several)

    @staticmethod
    def unsupported(model: nn.Module, plan: PrivacyPlan) -> str | None:
        # units: a sharded run's micro-batches hold whole units (`EngineOptions.whole_units`), clipped here at once;
        # elsewhere a unit may span micro-batches, which the hooks engine carries over
        if plan.privacy_unit != ROW and not is_sharded(model):
            return f"privacy_unit={plan.privacy_unit!r} clips the summed gradient of several rows"
        return unsupported_reason(model)

    def remove(self) -> None:
        super().remove()
        self.ghost.remove()


@register_clipper("hooks")
class HooksClipper(_Clipper):
    """Opacus' per-sample gradient hooks (every model Opacus supports; per-example gradients in `p.grad_sample`)."""

    how = "by Opacus hooks"
    label = "Opacus hooks (slower, more memory)"

    @staticmethod
    def unsupported(model: nn.Module, plan: PrivacyPlan) -> str | None:
        if is_sharded(model):  # measured: Opacus tags the sharded parameters, FSDP2 runs the gathered ones
            return ("Opacus hooks cannot clip a model sharded by FSDP2: they store per-sample gradients on the sharded "
                    "parameters, which the forward never uses, and need autograd's gradient, which FSDP2 would "
                    "reduce-scatter unclipped")
        return None

    def __init__(self, model: nn.Module, several=()):
        self._pre_hooks = [m.register_forward_pre_hook(opt_positions_pre_hook, with_kwargs=True)
                           for m in model.modules()
                           if isinstance(m, OPTLearnedPositionalEmbedding) and m.weight.requires_grad]
        self.hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
        super().__init__(model, several)

    def disable_hooks(self) -> None:
        self.hooks.disable_hooks()

    def enable_hooks(self) -> None:
        self.hooks.enable_hooks()

    def remove(self) -> None:
        for handle in self._pre_hooks:
            handle.remove()
        self._pre_hooks = []
        super().remove()
        self.hooks.remove_hooks()


def choose_clipper(requested: str, model: nn.Module, plan: PrivacyPlan) -> tuple[str, str | None]:
    """(the clipper to use, why the preferred one cannot clip this model, or None). `requested`: a registered
    name (refused with the reason when it cannot clip the model), or "auto": the first registered that can."""
    if requested != "auto":
        reason = CLIPPERS[requested].unsupported(model, plan)
        if reason is not None:
            raise DPConfigError(f"DPTrainer: clipping_engine={requested!r} cannot clip this model exactly: {reason}. "
                                "Use clipping_engine='hooks' (or 'auto').")
        return requested, None
    first_reason = None
    for name, cls in CLIPPERS.items():
        reason = cls.unsupported(model, plan)
        if reason is None:
            return name, first_reason
        first_reason = first_reason or reason
    raise DPConfigError(f"DPTrainer: no per-example clipping engine can clip this model: {first_reason}.")
