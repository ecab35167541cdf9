"""How `DPTrainer` gets per-example clipping: the ghost-norm engine when it supports the model, else Opacus hooks
(a mixin placed before `Trainer`; expects `self.model`, `self.args`, `self._dp_optimizer`)."""

from __future__ import annotations

from opacus.grad_sample import GradSampleHooks
from transformers.utils import logging

from .errors import DPConfigError
from .privacy.attributes import clear_dp_attributes
from .privacy.ghost_clipping import GhostClippingEngine, unsupported_reason

logger = logging.get_logger("hf_dp_repr.trainer")  # DPTrainer's own logger, as before the split


class DPClippingMixin:
    """Attach, remove and clean up the per-example clipping machinery of the model being trained."""

    _grad_sample_hooks = None
    _ghost_engine = None

    def _choose_engine(self) -> str:
        """'ghost' when it supports the model (and was not refused), else 'hooks'; a fallback is logged."""
        requested = self.args.clipping_engine
        if requested == "hooks":
            return "hooks"
        unit = getattr(self.args, "privacy_unit", "row")
        reason = (f"privacy_unit={unit!r} clips the summed gradient of several rows" if unit != "row"
                  else unsupported_reason(self.model))
        if reason is None:
            return "ghost"
        if requested == "ghost":
            raise DPConfigError(f"DPTrainer: clipping_engine='ghost' cannot clip this model exactly: {reason}. "
                                "Use clipping_engine='hooks' (or 'auto').")
        logger.warning(f"DPTrainer: per-example clipping falls back to Opacus hooks (slower, more memory): {reason}.")
        return "hooks"

    def _attach_hooks(self) -> None:
        if self._grad_sample_hooks is not None or self._ghost_engine is not None:
            return
        for name, p in self.model.named_parameters():
            p._dp_name = name  # for error messages that name the parameter
        engine = self._choose_engine()
        if engine != self.clipping_engine:
            logger.info(f"DPTrainer: clipping_engine={engine!r} (per-example clipping "
                        f"{'by ghost norms and book-keeping' if engine == 'ghost' else 'by Opacus hooks'}).")
        self.clipping_engine = engine
        if engine == "ghost":  # only modules that own a trained tensor are hooked (nothing below the scope)
            self._ghost_engine = GhostClippingEngine(self.model)
        else:
            self._grad_sample_hooks = GradSampleHooks(self.model, batch_first=True, loss_reduction="sum", strict=True)
        if self._dp_optimizer is not None:
            self._dp_optimizer.engine = self._ghost_engine

    def _remove_hooks(self) -> None:
        if self._grad_sample_hooks is not None:
            self._grad_sample_hooks.remove_hooks()
            self._grad_sample_hooks = None
        if self._ghost_engine is not None:
            self._ghost_engine.remove()
            self._ghost_engine = None

    def _detach_hooks(self) -> None:
        self._remove_hooks()
        clear_dp_attributes(self.model.parameters())
