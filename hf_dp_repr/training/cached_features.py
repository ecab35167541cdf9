"""Features computed once from frozen weights, in `DPTrainer` (`FeatureCaches`; evaluation through a mixin placed
before `Trainer`): the linear probe's head inputs (`cached_head`) or the hidden states entering the first trained
block (`prefix_cache`).

They are prepared when the Trainer asks for the training dataloader, i.e. after `model_init` has made the trial's
model and a checkpoint's weights were loaded, so they are always those of the model that trains (a sweep's trials
with the same frozen weights reuse them through the process-wide `feature_store`). Evaluation runs on them too:
the eval set's features are computed once, and only the head (or the trained blocks) runs per evaluation.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader
from transformers import default_data_collator
from transformers.utils import logging

from ..privacy.loss import per_example_loss
from ..scope.cached_head import HEAD_INPUTS_KEY, head_inputs_collator, head_inputs_for, prepare_cached_head
from ..scope.feature_store import NotCacheable, data_reason_not_to_cache
from ..scope.prefix_cache import (
    STATES_KEY,
    StatesCollator,
    StatesDataset,
    prepare_prefix_cache,
    run_from_states,
    states_for,
)
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)


class FeatureCaches:
    """The cached features of the run (`DPTrainer.features`): `prepare` decides and computes them when training
    starts; the training inputs, evaluation and prediction read them."""

    def __init__(self):
        self.cached_head = None  # name of the head module trained on cached inputs, if any
        self.cached_inputs = None
        self.prefix_cut = None  # trainable_blocks=k: where the frozen prefix ends (prefix_cache.CutPoint)
        self.prefix_states = None  # the training set's cached prefix states, if used
        self.ready = False  # prepared for the train() that runs now

    def prepare(self, model, scopes, args, train_dataset, dataset_and_collator) -> None:
        """Head inputs for a linear probe, else prefix states for the last k blocks, when they give the same
        updates; the reason is logged when not. `scopes`: the phases' scopes (none with a privacy unit: features
        are per row). `dataset_and_collator()`: the training set and collator as the trainer feeds them."""
        self.cached_head, self.cached_inputs, no_cache = prepare_cached_head(model, scopes, args, train_dataset,
                                                                             dataset_and_collator)
        if no_cache:
            logger.warning(f"DPTrainer: linear probe without cached features ({no_cache}); each step runs the "
                           "backbone.")
        self.prefix_cut, self.prefix_states, no_cache = prepare_prefix_cache(model, scopes, args, train_dataset,
                                                                             dataset_and_collator)
        if no_cache:
            logger.warning(f"DPTrainer: frozen blocks below block {self.prefix_cut.first} not cached ({no_cache}); "
                           "each step runs them.")
        self.ready = True

    def train_inputs(self, dataset_and_collator) -> tuple:
        """(dataset, collator) of the training steps: cached head inputs, cached prefix states, or the rows."""
        if self.cached_head is not None:
            return self.cached_inputs, default_data_collator
        dataset, collator = dataset_and_collator()
        if self.prefix_states is not None:
            dataset, collator = StatesDataset(dataset, self.prefix_states.states), StatesCollator(collator)
        return dataset, collator


class DPFeatureCacheMixin:
    """Evaluation and prediction on the cached features of `self.features` (a mixin placed before `Trainer`)."""

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """When training ran on cached features, evaluation does too (the eval set's features are computed once
        per process and frozen weights)."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        cache = self.features
        cached = cache.cached_head is not None or cache.prefix_states is not None
        if not cached or data_reason_not_to_cache(dataset) is not None:
            return super().get_eval_dataloader(eval_dataset)
        dataset = self._remove_unused_columns(dataset, description="evaluation")
        try:
            if cache.cached_head is not None:
                items = head_inputs_for(self.model, cache.cached_head, dataset, self.data_collator, self.args)
                collate = head_inputs_collator
            else:
                entry = states_for(self.model, cache.prefix_cut, dataset, self.data_collator, self.args)
                items, collate = StatesDataset(dataset, entry.states), StatesCollator(self.data_collator)
        except NotCacheable as e:
            logger.warning(f"DPTrainer: evaluation without cached features ({e}).")
            return super().get_eval_dataloader(eval_dataset)
        return self.accelerator.prepare(DataLoader(items, batch_size=self.args.eval_batch_size, collate_fn=collate,
                                                   num_workers=self.args.dataloader_num_workers))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        features = inputs.pop(HEAD_INPUTS_KEY, None)
        if features is not None:  # the probe's head alone, on the cached inputs; the loss the model would report
            labels = inputs["labels"]
            with torch.no_grad():
                logits = self.model.get_submodule(self.features.cached_head)(features)
                loss = per_example_loss(logits, labels).mean()
            return loss, None if prediction_loss_only else logits, labels
        states = inputs.pop(STATES_KEY, None)
        if states is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        cut = self.features.prefix_cut
        with run_from_states(self.model, cut.stack_name, cut.first, states):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
