"""Datasets that ship with the install, so the default run and the tests need no network.

Example:
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> ds = load_digits_dataset()
    >>> ds["train"].num_rows, ds["test"].num_rows
    (1437, 360)
    >>> ds["train"][0]["pixel_values"].shape
    torch.Size([1, 8, 8])
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset, DatasetDict

DIGITS_MEAN, DIGITS_STD = 4.88, 6.02  # per-pixel statistics of sklearn's digits (values 0..16)


def load_digits_dataset(test_size: float = 0.2, seed: int = 0) -> DatasetDict:
    """sklearn's 1797 8×8 handwritten digits as a `DatasetDict` ("train"/"test").

    Columns: `pixel_values` (float32 tensor of shape (1, 8, 8), standardised) and `labels` (int, 0-9).
    The split is stratified and fixed by `seed`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = ((digits.images - DIGITS_MEAN) / DIGITS_STD).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=test_size, random_state=seed, stratify=labels
    )

    def split(idx):
        return Dataset.from_dict({"pixel_values": images[idx], "labels": labels[idx]}).with_format("torch")

    return DatasetDict(train=split(idx_train), test=split(idx_test))
