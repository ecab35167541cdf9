"""Batch samplers that yield exactly `micro_batches_per_step` micro-batches per logical DP step.

The Trainer consumes `gradient_accumulation_steps` micro-batches per optimizer step, so one logical batch
(the unit the accountant sees) is drawn at once and split. With several processes, every rank draws the
same global batch (same seed) and keeps its own slice, so the batch is Poisson over the whole dataset and
no communication is needed.

Example:
    >>> from hf_dp_repr.privacy.sampler import PoissonBatchSampler
    >>> sampler = PoissonBatchSampler(num_samples=1000, sample_rate=0.05, steps_per_epoch=20,
    ...                               micro_batches_per_step=2, seed=0)
    >>> len(sampler), len(list(sampler))
    (40, 40)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Sampler
from transformers import TrainerCallback

from ..errors import UnsupportedError
from .validation import check_one_row_per_example

UNIT_KEY = "dp_unit_index"  # the per-row unit index a batch carries to the optimizer (privacy.units)


class _LogicalBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        num_samples: int,
        steps_per_epoch: int,
        micro_batches_per_step: int = 1,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
    ):
        self.num_samples = num_samples
        self.steps_per_epoch = steps_per_epoch
        self.micro_batches_per_step = micro_batches_per_step
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        # The Trainer calls this each epoch; batches then depend only on (seed, epoch), which makes resume exact.
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches_per_step

    def _draw(self, rng: np.random.Generator, step: int) -> np.ndarray:
        raise NotImplementedError

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        for i in range(self.steps_per_epoch):
            mine = self._draw(rng, self.epoch * self.steps_per_epoch + i)[self.rank :: self.world_size]
            for chunk in np.array_split(mine, self.micro_batches_per_step):
                yield chunk.tolist()


class PoissonBatchSampler(_LogicalBatchSampler):
    """Each example joins each logical batch independently with probability `sample_rate` (the setting of
    the accountants' analysis); batch sizes vary and a micro-batch may be empty. `seed` must be secret
    (`privacy.randomness`): whoever knows the batches loses nothing to the subsampling.

    `sample_rate` may be a function of the global step (phases of a run with different batch sizes).
    `secure=True` draws from OS entropy instead of a seeded generator (single process only)."""

    def __init__(self, num_samples: int, sample_rate: float | Callable[[int], float], steps_per_epoch: int, *,
                 secure: bool = False, **kw):
        super().__init__(num_samples, steps_per_epoch, **kw)
        if secure and self.world_size > 1:
            raise UnsupportedError(
                "secure_mode with several processes: OS-entropy batches cannot be shared between ranks without "
                "communication. Run secure_mode in a single process."
            )
        self.sample_rate = sample_rate
        self.secure = secure

    def _draw(self, rng: np.random.Generator, step: int) -> np.ndarray:
        rate = self.sample_rate(step) if callable(self.sample_rate) else self.sample_rate
        if self.secure:
            uniform = np.frombuffer(os.urandom(8 * self.num_samples), dtype=np.uint64) / 2.0**64
        else:
            uniform = rng.random(self.num_samples)
        # Order inside the batch does not matter to DP; shuffling keeps micro-batches of similar make-up.
        return rng.permutation(np.flatnonzero(uniform < rate))


class ShuffledBatchSampler(_LogicalBatchSampler):
    """Fixed-size logical batches from a shuffle of the dataset (sampling without replacement).
    The Poisson-based accountants do not cover this scheme; DPTrainer warns when it is used."""

    def __init__(self, num_samples: int, batch_size: int, steps_per_epoch: int, **kw):
        super().__init__(num_samples, steps_per_epoch, **kw)
        self.batch_size = batch_size
        self._order: np.ndarray | None = None
        self._cursor = 0

    def __iter__(self):
        self._order, self._cursor = None, 0
        return super().__iter__()

    def _draw(self, rng: np.random.Generator, step: int) -> np.ndarray:
        if self._order is None:
            self._order = rng.permutation(self.num_samples)
        batch = self._order[self._cursor : self._cursor + self.batch_size]
        self._cursor += self.batch_size
        return batch


class ExampleBatchCollator:
    """Collates as usual, but an empty Poisson micro-batch becomes {} instead of crashing the collator, and a
    batch whose rows are not its examples (packing) is refused: DP-SGD clips, samples and accounts per row."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        if not features:
            return {}
        units = None
        if UNIT_KEY in features[0]:  # privacy_unit: each row's unit index travels beside the batch
            units = torch.tensor([f[UNIT_KEY] for f in features], dtype=torch.long)
            features = [{k: v for k, v in f.items() if k != UNIT_KEY} for f in features]
        batch = self.collator(features)
        check_one_row_per_example(batch, len(features))
        if units is not None:
            batch[UNIT_KEY] = units
        return batch


class SamplerEpochCallback(TrainerCallback):
    """Tells the batch sampler which epoch starts, so batches depend only on (seed, epoch), also on resume.
    `sampler_of()` returns the trainer's current sampler (None before its dataloader exists)."""

    def __init__(self, sampler_of: Callable[[], _LogicalBatchSampler | None]):
        self.sampler_of = sampler_of

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self.sampler_of()
        if sampler is not None:
            sampler.set_epoch(int(state.epoch or 0))
