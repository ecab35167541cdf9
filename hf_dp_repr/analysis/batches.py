"""Batches for the analyzers: from a 🤗 `Dataset` / `IterableDataset` or any iterable of batch dicts.

Kept apart from the maths so that `features.py` reads as "forward, select, accumulate".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ArgumentError, ArgumentTypeError, DataError, MissingColumnError

VISION, LANGUAGE, TEXT = "image-classification", "causal-lm", "text-classification"
TASKS = (VISION, LANGUAGE, TEXT)
LABELLED = (VISION, TEXT)  # measured against a class label per example (D and PR), not against the next token


def is_hf_dataset(data: Any) -> bool:
    import datasets

    return isinstance(data, (datasets.Dataset, datasets.IterableDataset))


def iter_batches(data: Any, batch_size: int, max_examples: int | None) -> tuple[Iterator[Mapping], int | None]:
    """(iterator of batch dicts, number of batches or None if unknown), stopping after `max_examples` rows."""
    if batch_size < 1:
        raise ArgumentError(f"`batch_size` must be ≥ 1, got {batch_size}")
    if max_examples is not None and max_examples < 1:
        raise ArgumentError(f"`max_examples` must be ≥ 1 or None, got {max_examples}")
    if is_hf_dataset(data):
        import datasets

        if isinstance(data, datasets.Dataset):
            n = len(data) if max_examples is None else min(len(data), max_examples)
            if n == 0:
                raise DataError("the analysis dataset is empty; pass a dataset with at least one row")
            return data.select(range(n)).iter(batch_size=batch_size), -(-n // batch_size)
        data = data if max_examples is None else data.take(max_examples)
        return data.iter(batch_size=batch_size), None
    if isinstance(data, Mapping) or not isinstance(data, Iterable):
        raise ArgumentTypeError("`dataset` must be a 🤗 Dataset/IterableDataset or an iterable of batch dicts "
                                f"(e.g. a DataLoader), got {type(data).__name__}")
    total = len(data) if hasattr(data, "__len__") else None
    return _truncate(data, max_examples), total


def _truncate(batches: Iterable[Mapping], max_examples: int | None) -> Iterator[Mapping]:
    seen = 0
    for batch in batches:
        size = batch_size_of(batch)
        if max_examples is not None and seen + size > max_examples:
            keep = max_examples - seen
            batch = {k: v[:keep] for k, v in batch.items()}
            size = keep
        if size > 0:
            yield batch
        seen += size
        if max_examples is not None and seen >= max_examples:
            return


def batch_size_of(batch: Mapping) -> int:
    for key in ("pixel_values", "input_ids"):
        if key in batch:
            return len(batch[key])
    raise MissingColumnError("a batch needs `pixel_values` (vision) or `input_ids` (language); got keys "
                             f"{sorted(batch)}")


def detect_task(batch: Mapping) -> str:
    if "pixel_values" in batch:
        return VISION
    if "input_ids" in batch:
        return LANGUAGE
    raise MissingColumnError(f"cannot tell the task from columns {sorted(batch)}: expected `pixel_values` (vision) or "
                             "`input_ids` (language); preprocess the dataset or pass `task=`")


def to_tensor(values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, list) and values and isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    return torch.as_tensor(np.asarray(values))


def language_inputs(batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) as (B, T) int64 tensors; ragged lists are right-padded with id 0, mask 0."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if isinstance(ids, torch.Tensor) or (ids and isinstance(ids[0], torch.Tensor) and _same_length(ids)):
        ids = to_tensor(ids).long()
        mask = torch.ones_like(ids) if mask is None else to_tensor(mask).long()
        return ids, mask
    rows = [list(map(int, row)) for row in ids]
    masks = [list(map(int, m)) for m in mask] if mask is not None else [[1] * len(r) for r in rows]
    width = max(len(r) for r in rows)
    padded = torch.zeros(len(rows), width, dtype=torch.long)
    padded_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (row, m) in enumerate(zip(rows, masks)):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        padded_mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return padded, padded_mask


def _same_length(rows: list) -> bool:
    return len({len(r) for r in rows}) == 1
