"""Evaluation on cached prefix states: when `DPTrainer` trained on them, evaluation does too (a mixin placed before
`Trainer`; expects `self._prefix_states` and `self._prefix_cut` set by `DPTrainer.train`)."""

from __future__ import annotations

import datasets
from torch.utils.data import DataLoader
from transformers.utils import logging

from .prefix_cache import STATES_KEY, NotCacheable, StatesCollator, StatesDataset, run_from_states, states_for

logger = logging.get_logger("hf_dp_repr.trainer")  # DPTrainer's own logger, as before the split


class DPPrefixEvalMixin:
    _prefix_states = None
    _prefix_cut = None

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """When training ran on cached prefix states, evaluation does too (the eval set's states are computed once
        per process and frozen weights)."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        if self._prefix_states is None or not isinstance(dataset, datasets.Dataset):
            return super().get_eval_dataloader(eval_dataset)
        dataset = self._remove_unused_columns(dataset, description="evaluation")
        try:
            entry = states_for(self.model, self._prefix_cut, dataset, self.data_collator, self.args)
        except NotCacheable as e:
            logger.warning(f"DPTrainer: evaluation without cached prefix states ({e}).")
            return super().get_eval_dataloader(eval_dataset)
        return self.accelerator.prepare(DataLoader(
            StatesDataset(dataset, entry.states), batch_size=self.args.eval_batch_size,
            collate_fn=StatesCollator(self.data_collator), num_workers=self.args.dataloader_num_workers))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        states = inputs.pop(STATES_KEY, None)
        if states is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with run_from_states(self.model, self._prefix_cut.stack_name, self._prefix_cut.first, states):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
