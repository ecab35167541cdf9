"""Datasets that ship with the install, so the default run and the tests need no network.

- `load_digits_dataset()`: sklearn's 8×8 handwritten digits (image classification).
- `load_stdlib_topics()`: paragraphs of Python's standard-library docstrings, labelled by their module (text
  classification).

Example:
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> ds = load_digits_dataset()
    >>> ds["train"].num_rows, ds["test"].num_rows
    (1437, 360)
    >>> ds["train"][0]["pixel_values"].shape
    torch.Size([1, 8, 8])
    >>> topics = load_stdlib_topics()
    >>> topics["train"].features["labels"].names[:3], topics["train"].num_rows > 1000
    (['argparse', 'collections', 'pathlib'], True)
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


def load_stdlib_topics(min_examples_per_class: int = 50, min_chars: int = 40, test_size: float = 0.2,
                       seed: int = 0) -> DatasetDict:
    """A topic-classification task from real English that ships with Python: each example is one paragraph of a
    standard-library docstring (see `hf_dp_repr.analysis.corpus.stdlib_docstrings`), its label is the module the
    docstring comes from (`logging`, `inspect`, `doctest`, ...).

    Paragraphs shorter than `min_chars` characters are dropped, and so are modules with fewer than
    `min_examples_per_class` paragraphs (18 modules, about 1,700 paragraphs with the defaults on Python 3.11).
    Columns: `text` (str) and `labels` (ClassLabel named by module). The split is stratified and fixed by `seed`.
    Under DP, the unit of privacy is one paragraph: a docstring of several paragraphs is several examples.
    """
    from collections import Counter

    from datasets import ClassLabel, Features, Value
    from sklearn.model_selection import train_test_split

    from hf_dp_repr.analysis.corpus import STDLIB_MODULES, stdlib_docstrings

    rows = [(" ".join(p.split()), module) for module, doc in stdlib_docstrings()
            for p in doc.split("\n\n") if len(p.strip()) >= min_chars]
    counts = Counter(module for _, module in rows)
    names = [m for m in STDLIB_MODULES if counts[m] >= min_examples_per_class]
    if len(names) < 2:
        raise ValueError(f"min_examples_per_class={min_examples_per_class} leaves {len(names)} module(s); lower it")
    rows = [(text, names.index(module)) for text, module in rows if module in names]
    texts, labels = zip(*rows)
    idx_train, idx_test = train_test_split(np.arange(len(rows)), test_size=test_size, random_state=seed,
                                           stratify=labels)
    features = Features({"text": Value("string"), "labels": ClassLabel(names=names)})

    def split(idx):
        return Dataset.from_dict({"text": [texts[i] for i in idx], "labels": [labels[i] for i in idx]},
                                 features=features)

    return DatasetDict(train=split(idx_train), test=split(idx_test))
