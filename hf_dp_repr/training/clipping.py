"""How `DPTrainer` gets per-example clipping: the ghost-norm engine when it supports the model, else Opacus hooks
(a mixin placed before `Trainer`; expects `self.model`, `self.args`, `self._dp_optimizer`)."""

from __future__ import annotations

import contextlib

from opacus.grad_sample import GradSampleHooks
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.utils import logging

from ..errors import DPConfigError
from ..privacy.attributes import clear_dp_attributes
from ..privacy.batch_rows import ExampleRows
from ..privacy.ghost_clipping import GhostClippingEngine, unsupported_reason
from ..privacy.grad_samplers import opt_positions_pre_hook
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)


class DPClippingMixin:
    """Attach, remove and clean up the per-example clipping machinery of the model being trained."""

    _grad_sample_hooks = None
    _ghost_engine = None
    _example_rows = None  # ExampleRows: every hooked module's rows checked against the micro-batch's examples
    _several_rows = frozenset()  # paths of the modules the start-of-training probe found with several rows per example
    _opacus_pre_hooks = ()

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
            self._ghost_engine = GhostClippingEngine(self.model, several=self._several_rows)
        else:
            self._opacus_pre_hooks = [m.register_forward_pre_hook(opt_positions_pre_hook, with_kwargs=True)
                                      for m in self.model.modules()
                                      if isinstance(m, OPTLearnedPositionalEmbedding) and m.weight.requires_grad]
            self._grad_sample_hooks = GradSampleHooks(self.model, batch_first=True, loss_reduction="sum", strict=True)
        self._example_rows = ExampleRows(self.model, self._several_rows, opacus=engine == "hooks")
        if self._dp_optimizer is not None:
            self._dp_optimizer.engine = self._ghost_engine

    def _clipping_recording(self, n: int):
        """Around one micro-batch's forward and backward (n examples): the rows check, and the ghost engine's
        recording."""
        stack = contextlib.ExitStack()
        if self._example_rows is not None:
            stack.enter_context(self._example_rows.expect(n))
        if self._ghost_engine is not None:
            stack.enter_context(self._ghost_engine.recording(n))
        return stack

    def _remove_hooks(self) -> None:
        for handle in self._opacus_pre_hooks:
            handle.remove()
        self._opacus_pre_hooks = ()
        if self._example_rows is not None:
            self._example_rows.remove()
            self._example_rows = None
        if self._grad_sample_hooks is not None:
            self._grad_sample_hooks.remove_hooks()
            self._grad_sample_hooks = None
        if self._ghost_engine is not None:
            self._ghost_engine.remove()
            self._ghost_engine = None

    def _detach_hooks(self) -> None:
        self._remove_hooks()
        clear_dp_attributes(self.model.parameters())
