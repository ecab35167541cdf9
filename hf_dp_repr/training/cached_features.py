"""Features computed once from frozen weights, in `DPTrainer` (`FeatureCaches`; evaluation on them:
`cached_eval_inputs`, `head_prediction`, `from_cached_states`): the linear probe's head inputs (`cached_head`) or
the hidden states entering the first trained block (`prefix_cache`).

They are prepared when the Trainer asks for the training dataloader, i.e. after `model_init` has made the trial's
model and a checkpoint's weights were loaded, so they are always those of the model that trains (a sweep's trials
with the same frozen weights reuse them through the process-wide `feature_store`). Evaluation runs on them too:
the eval set's features are computed once, and only the head (or the trained blocks) runs per evaluation.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import default_data_collator
from transformers.utils import logging

from ..privacy.loss import per_example_loss
from ..scope.cached_head import head_inputs_collator, head_inputs_for, prepare_cached_head
from ..scope.feature_store import NotCacheable, data_reason_not_to_cache
from ..scope.prefix_cache import (
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


def cached_eval_inputs(trainer, eval_dataset=None) -> tuple | None:
    """(items, collator) of an evaluation on cached features when training ran on them (the eval set's features are
    computed once per process and frozen weights), or None: the Trainer's own evaluation dataloader."""
    dataset = trainer.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
    dataset = trainer.eval_dataset if dataset is None else dataset
    cache = trainer.features
    cached = cache.cached_head is not None or cache.prefix_states is not None
    if not cached or data_reason_not_to_cache(dataset) is not None:
        return None
    dataset = trainer._remove_unused_columns(dataset, description="evaluation")
    try:
        if cache.cached_head is not None:
            items = head_inputs_for(trainer.model, cache.cached_head, dataset, trainer.data_collator, trainer.args)
            return items, head_inputs_collator
        entry = states_for(trainer.model, cache.prefix_cut, dataset, trainer.data_collator, trainer.args)
        return StatesDataset(dataset, entry.states), StatesCollator(trainer.data_collator)
    except NotCacheable as e:
        logger.warning(f"DPTrainer: evaluation without cached features ({e}).")
        return None


def head_prediction(trainer, features, labels, prediction_loss_only: bool) -> tuple:
    """`prediction_step` on cached head inputs: the probe's head alone; the loss the model would report."""
    with torch.no_grad():
        logits = trainer.model.get_submodule(trainer.features.cached_head)(features)
        loss = per_example_loss(logits, labels).mean()
    return loss, None if prediction_loss_only else logits, labels


def from_cached_states(trainer, states):
    """A forward of the trained blocks alone, from the cached states entering them (`states`, or None: the model)."""
    if states is None:
        return contextlib.nullcontext()
    cut = trainer.features.prefix_cut
    return run_from_states(trainer.model, cut.stack_name, cut.first, states)
