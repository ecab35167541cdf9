import os

import numpy as np
import pytest
import torch
from datasets import Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def digits():
    from hf_dp_repr.data import load_digits_dataset

    return load_digits_dataset()


def make_token_dataset(n: int = 24, length: int = 8, vocab: int = 128, seed: int = 0) -> Dataset:
    """Random token sequences with right padding of random length (labels -100 on padding)."""
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        valid = int(rng.integers(3, length + 1))
        ids = rng.integers(1, vocab, size=length)
        mask = (np.arange(length) < valid).astype(np.int64)
        ids = np.where(mask == 1, ids, 0)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append(mask)
        rows["labels"].append(np.where(mask == 1, ids, -100))
    return Dataset.from_dict(rows).with_format("torch")


@pytest.fixture
def token_dataset():
    return make_token_dataset()


def make_token_classification_dataset(n: int = 24, length: int = 8, vocab: int = 128, num_labels: int = 2,
                                      seed: int = 0) -> Dataset:
    """Random token sequences (right-padded) with a random class label each."""
    rows = make_token_dataset(n, length, vocab, seed).with_format(None).to_dict()
    rows["labels"] = np.random.default_rng(seed + 1).integers(0, num_labels, size=n).tolist()
    return Dataset.from_dict(rows).with_format("torch")
