"""Augmentation multiplicity (De et al. 2022), `DPTrainingArguments(augmentation_multiplicity=k)`: each sampled
example is read k times through the training set's own random transform (`Dataset.set_transform` /
`with_transform`, or a torch Dataset's random `__getitem__`), fresh at every step; the k views' losses are
averaged, so the mean of their gradients is what is clipped, once, as one contribution.

- What is one example: still one row of the training set (or one unit of `privacy_unit`). Its k views travel
  as k rows with the example's id under `UNIT_KEY`, and the clipping engines' unit machinery (`privacy.units`,
  `MicroBatchDPOptimizer`) sums their gradients before clipping. The views of a row are laid out together inside
  one micro-batch, so a row is never cut (the ghost engine clips it too). Sampling and accounting are untouched:
  the same q, steps, σ and ε as with k = 1.
- Sensitivity: whatever the views (a transform is arbitrary code, possibly adversarial), one example adds at most
  C to the clipped sum, so replacing it moves the sum by at most 2C.
- Randomness: each view's draws (Python's `random`, numpy's and torch's global CPU generators, which transforms
  such as torchvision's read) are seeded from (the Trainer's public `seed`, epoch, step, row, view), and the
  generators are put back after each micro-batch, so views are reproducible from the run's seed and the process's
  own generators are left as they were. They never touch the DP secret (`privacy.randomness`): the guarantee
  holds for every fixed choice of views, so the augmentation needs no secrecy.

Example:
    >>> import torch
    >>> from hf_dp_repr.privacy.augmentation import ViewsBatchSampler, ViewsDataset
    >>> class Noisy(torch.utils.data.Dataset):
    ...     def __len__(self): return 4
    ...     def __getitem__(self, i): return {"x": float(i) + torch.rand(()).item()}
    >>> views = ViewsDataset(Noisy(), seed=0)
    >>> batches = list(ViewsBatchSampler([[1, 3]], k=2))
    >>> [views[key][views.UNIT] for key in batches[0]], [views[key] == views[key] for key in batches[0]]
    ([1, 1, 3, 3], [True, True, True, True])
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from .sampler import UNIT_KEY

_VIEWS = 4  # purpose word of the SeedSequence key (apart from any other use of the public seed)


@contextlib.contextmanager
def preserved_generators():
    """Python's, numpy's and torch's (CPU) global generators put back as they were on exit."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def seed_generators(key: list[int]) -> None:
    """Python's, numpy's and torch's (CPU) global generators seeded from `key` (`torch.default_generator`: a
    `torch.manual_seed` would also seed every accelerator's generator, and cost 100× more)."""
    seed = np.random.SeedSequence(key).generate_state(2)
    random.seed(int(seed[0]))
    np.random.seed(int(seed[1]))
    torch.default_generator.manual_seed(int(seed[0]) << 32 | int(seed[1]))


class ViewsDataset(torch.utils.data.Dataset):
    """Reads views of `dataset`'s rows: item `(row, key)` is `dataset[row]` with the generators seeded from
    (`seed`, key), and carries the row's unit under `UNIT_KEY` (the row itself, unless the row has one already:
    `privacy.units.UnitRowsDataset`). A plain index reads view 0 of step 0."""

    UNIT = UNIT_KEY

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item) -> dict:
        with preserved_generators():
            return self._view(item)

    def __getitems__(self, items: list) -> list[dict]:
        """A micro-batch (torch's DataLoader asks for it whole): the generators are saved and restored once for it,
        not once per view (each view is still seeded from its own key)."""
        with preserved_generators():
            return [self._view(item) for item in items]

    def _view(self, item) -> dict:
        row, key = (item, (0, 0, item, 0)) if isinstance(item, int) else item
        seed_generators([self.seed, _VIEWS, *key])
        example = dict(self.dataset[row])
        example.setdefault(UNIT_KEY, int(row))
        return example


class ViewsBatchSampler:
    """Each micro-batch of `batches` (lists of rows) with every row repeated `k` times, as `(row, key)` items for
    `ViewsDataset`; key = (epoch, logical step of the epoch, row, view): a row is drawn at most once per step, and
    its views do not depend on how the step is split into micro-batches and processes (a sharded or multi-process
    run reads the views a single process reads). `epoch` follows `batches.epoch` and the step
    `batches.micro_batches_per_step` (the DP sampler's; the trainer sets the epoch at every epoch)."""

    def __init__(self, batches, k: int):
        self.batches, self.k = batches, k

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        epoch = getattr(self.batches, "epoch", 0)
        per_step = getattr(self.batches, "micro_batches_per_step", 1)
        for b, rows in enumerate(self.batches):
            yield [(row, (epoch, b // per_step, row, view)) for row in rows for view in range(self.k)]
