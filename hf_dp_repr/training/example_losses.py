"""The hooks of one micro-batch, outermost first: `examples_in_batch`, `example_losses`, `per_example_loss`, then
`row_units` (which rows the clipper clips together), the modules' modes a training forward runs in
(`set_training_modes`) and the start-of-training probe of the rows (`probe_rows`).

A Trainer subclass whose loss is a sum of per-example terms overrides one of them (`hf_dp_repr.trl.dp_trainer_class`).
Each example's loss must depend on its own rows only (checked by the start-of-training probe); the batch's tensors are
example-first (row i of each is example i).
"""

from __future__ import annotations

import torch
from transformers.utils import ModelOutput

from ..errors import MissingColumnError
from ..privacy.grad_samplers import batch_position_ids
from ..privacy.loss import per_example_loss
from ..privacy.row_probe import probe_training_rows
from ..scope.cached_head import set_probe_modes
from ..scope.prefix_cache import run_from_states, set_frozen_prefix_modes


class DPExampleLossMixin:
    """`DPTrainer`'s own per-example hooks (no `Trainer` member among them): what a subclass overrides."""

    batch_has_labels = True  # False: `example_losses` reads other keys (the probe and input checks then skip labels)

    def examples_in_batch(self, inputs: dict) -> int:
        """Examples in a prepared micro-batch (what the clipper expects to see): the rows of its `labels`."""
        if "labels" not in inputs:
            raise MissingColumnError("DPTrainer: the batch has no `labels`; per-example losses need them.")
        return len(inputs["labels"])

    def example_losses(self, model, inputs: dict, states=None) -> torch.Tensor:
        """Forward one prepared micro-batch and return the loss of each example, shape (examples,): what DP-SGD
        differentiates (their sum) and clips per example. Default: the model's outputs through `per_example_loss`.
        `states`: hidden states cached for the trained blocks (`cache_features`), or None."""
        labels = inputs.pop("labels")
        batch_position_ids(self.model, inputs)
        cache = self.features
        if cache.cached_head is not None and "features" in inputs:  # (the start-of-training probe runs the model)
            outputs = ModelOutput(logits=self.model.get_submodule(cache.cached_head)(inputs["features"]))
        elif states is not None:  # only the trained blocks run, from the cached states
            with run_from_states(self.model, cache.prefix_cut.stack_name, cache.prefix_cut.first, states):
                outputs = model(**inputs)
        else:
            outputs = model(**inputs)
        return self.per_example_loss(outputs, labels)

    def per_example_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Loss of each example of the micro-batch, shape (batch,). Override for custom objectives."""
        return per_example_loss(outputs.logits, labels, shift_labels=self._shifts_labels,
                                label_smoothing=self.args.label_smoothing_factor)

    def set_training_modes(self, scope=None) -> None:
        """The modules' modes of a training forward in the phase of `scope` (also what the start-of-training probe
        runs): train mode, but a linear probe's frozen backbone and a cut's frozen prefix in eval mode."""
        self.model.train()
        if scope is not None and scope.head_only:  # a linear probe: the frozen backbone in eval mode, as when cached
            set_probe_modes(self.model, scope.head_modules)
        elif self.features.prefix_cut is not None:  # the frozen blocks in eval mode, cached or not
            set_frozen_prefix_modes(self.model, self.features.prefix_cut)

    def row_units(self, inputs: dict, unit_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The unit of each row the clipper sees, after the backward of `inputs`: the collated privacy-unit ids (None:
        each row is its own example). Override when one example is several model rows (DPO: a pair's two rows)."""
        return unit_ids

    def probe_rows(self, dataset, collate, scope=None) -> set[str]:
        """The start-of-training probe (`privacy.row_probe.probe_training_rows`): refuse a model or collator that mixes
        examples; returns the trained modules that see several rows per example. Override with `example_losses`."""
        return probe_training_rows(self, dataset, collate, scope)
