"""The unit of privacy: one row (default) or all rows that share a value of a dataset column (a document, a
user). With `DPTrainingArguments(privacy_unit="user_id")` a unit is what is sampled, clipped and accounted:

- sampling (`UnitPoissonBatchSampler`): each *unit* joins a logical batch with probability q = L / U
  (L expected units per step, U units); all its rows come with it (at most `max_rows_per_unit`, a subset drawn
  from the run's secret randomness). With several processes a unit goes whole to one rank.
- micro-batches: a logical batch's rows are laid out unit after unit and split into the accumulation
  micro-batches, so a unit with many rows may span micro-batches, but only at a boundary: at most one unit
  is "open" (its partial gradient summed, not yet clipped) between two micro-batches. Memory: one extra
  parameter-sized buffer, whatever the units' sizes. `whole_units=True` (sharded runs, whose ghost engine clips
  a unit within one micro-batch) cuts only between units instead: micro-batches of uneven sizes, no open unit.
- clipping (`sum_per_unit`, used by `MicroBatchDPOptimizer`): the per-row gradients of a unit are summed,
  then the sum is clipped to C as ONE contribution. Removing a unit changes the update by at most C/L.
- accounting: n = U units; the ledger, the logs and the model card name the unit.

Example:
    >>> import torch
    >>> from hf_dp_repr.privacy.units import sum_per_unit, unit_rows
    >>> ids, n_units = unit_rows(["a", "b", "a", "c"])
    >>> ids.tolist(), n_units
    ([0, 1, 0, 2], 3)
    >>> rows = [torch.tensor([[1.0], [2.0], [3.0]])]        # one parameter, 3 rows
    >>> units, per_unit = sum_per_unit(rows, torch.tensor([7, 9, 7]))
    >>> units.tolist(), per_unit[0].flatten().tolist()
    ([7, 9], [4.0, 2.0])
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import DataError, MissingColumnError, UnsupportedError
from .sampler import UNIT_KEY, _LogicalBatchSampler

ROW = "row"


def describe_unit(privacy_unit: str) -> str:
    """'one example (row)' or 'one document (all rows sharing a document_id)': how logs and cards name a unit."""
    if privacy_unit == ROW:
        return "one example (row)"
    name = privacy_unit[:-3] if privacy_unit.endswith("_id") and len(privacy_unit) > 3 else privacy_unit
    return f"one {name} (all rows sharing a {privacy_unit})"


def unit_rows(values: Sequence) -> tuple[np.ndarray, int]:
    """(index of each row's unit in 0..U-1, U) from a column's values; refuses missing values (None, NaN), which
    would silently make one unit of all unlabelled rows or drop them from the guarantee."""
    missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))]
    if missing:
        raise DataError(f"DPTrainer: the privacy_unit column has {len(missing)} missing value(s) (rows "
                        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}). Every row must name its unit: fill them "
                        "(e.g. a unique id per unlabelled row, if each is its own unit) or drop those rows.")
    index: dict = {}
    ids = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    return ids, len(index)


def column_values(dataset, column: str) -> list:
    """The values of `column` for every row of a `datasets.Dataset` or a map-style dataset of dicts."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            raise MissingColumnError(f"DPTrainer: privacy_unit={column!r} but the training set has no such column "
                                     f"(columns: {names}). Add the column, or use privacy_unit='row'.")
        plain = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset
        return list(plain[column])  # Python values: a torch format would give 0-d tensors, each its own "unit"
    values = []
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict) or column not in row:
            raise MissingColumnError(f"DPTrainer: privacy_unit={column!r} but row {i} of the training set has no such "
                                     "key. Every row must carry its unit, or use privacy_unit='row'.")
        value = row[column]
        values.append(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)
    return values


class UnitRowsDataset(torch.utils.data.Dataset):
    """Rows of `dataset` with the unit column dropped and the unit's index added under `UNIT_KEY`."""

    def __init__(self, dataset, row_unit: np.ndarray, column: str):
        self.dataset, self.row_unit, self.column = dataset, row_unit, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = {k: v for k, v in self.dataset[i].items() if k != self.column}
        row[UNIT_KEY] = int(self.row_unit[i])
        return row


class UnitPoissonBatchSampler(_LogicalBatchSampler):
    """Poisson sampling of units: each unit joins each logical batch with probability `sample_rate`; its rows
    (at most `max_rows_per_unit`, drawn with the secret generator) are laid out contiguously, so the split into
    micro-batches cuts a unit only at a boundary (`whole_units=True`: never; each micro-batch holds whole units,
    cut where the rows are closest to an even split). `row_unit[i]` is row i's unit; `seed` must be secret."""

    def __init__(self, row_unit: np.ndarray, num_units: int, sample_rate, steps_per_epoch: int, *,
                 max_rows_per_unit: int | None = None, secure: bool = False, whole_units: bool = False, **kw):
        super().__init__(num_units, steps_per_epoch, **kw)
        if secure and self.world_size > 1:
            raise UnsupportedError("secure_mode with several processes: run secure_mode in a single process.")
        order = np.argsort(row_unit, kind="stable")
        starts = np.searchsorted(row_unit[order], np.arange(num_units + 1))
        self.rows_of = [order[starts[u]:starts[u + 1]] for u in range(num_units)]
        self.sample_rate, self.max_rows, self.secure = sample_rate, max_rows_per_unit, secure
        self.whole_units = whole_units

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        for i in range(self.steps_per_epoch):
            rate = self.sample_rate(self.epoch * self.steps_per_epoch + i) if callable(self.sample_rate) \
                else self.sample_rate
            if self.secure:
                uniform = np.frombuffer(os.urandom(8 * self.num_samples), dtype=np.uint64) / 2.0**64
            else:
                uniform = rng.random(self.num_samples)
            units = rng.permutation(np.flatnonzero(uniform < rate))[self.rank :: self.world_size]
            rows = [self._rows(u, rng) for u in units]
            if self.whole_units:
                yield from self._whole_units(rows)
                continue
            mine = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
            for chunk in np.array_split(mine, self.micro_batches_per_step):
                yield chunk.tolist()

    def _whole_units(self, rows: list[np.ndarray]):
        """The units' rows in `micro_batches_per_step` micro-batches, each cut at the unit boundary nearest (at or
        after) an even split of the rows; never inside a unit."""
        ends = np.cumsum([len(r) for r in rows], dtype=np.int64)
        total = int(ends[-1]) if len(ends) else 0
        k = self.micro_batches_per_step
        cuts = np.searchsorted(ends, [total * j / k for j in range(1, k)], side="left") + 1
        start = 0
        for stop in [*cuts.tolist(), len(rows)]:
            stop = max(start, min(stop, len(rows)))
            yield np.concatenate(rows[start:stop]).tolist() if stop > start else []
            start = stop

    def _rows(self, unit: int, rng: np.random.Generator) -> np.ndarray:
        rows = self.rows_of[unit]
        if self.max_rows is not None and len(rows) > self.max_rows:
            rows = np.sort(rng.choice(rows, size=self.max_rows, replace=False))
        return rows


def sum_per_unit(per_row: list[torch.Tensor], unit_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(unit ids in order of first appearance, per-unit gradient sums (units, ...) per parameter) from per-row,
    per-sample gradients (rows, ...) and each row's unit id. The one place rows become units: a clipping engine
    that computes per-row gradients calls this before clipping."""
    uniq, inverse = torch.unique(unit_ids, return_inverse=True)
    first = torch.full((len(uniq),), len(unit_ids), dtype=torch.long, device=unit_ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(unit_ids), device=unit_ids.device), reduce="amin")
    order = torch.argsort(first)  # keep the rows' order: the last unit of a micro-batch may continue in the next
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    slot = rank[inverse]
    sums = [torch.zeros((len(uniq), *g.shape[1:]), dtype=g.dtype, device=g.device).index_add_(0, slot, g)
            for g in per_row]
    return uniq[order], sums
