"""Weighted k-nearest-neighbour probe of frozen features, DINO protocol (Caron et al. 2021).

Features are L2-normalised; each query takes its k = 20 most cosine-similar memory features, and each
neighbour votes for its class with weight exp(similarity / 0.07). Accuracy is the fraction of queries whose
top-voted class is their label.

Example:
    >>> import numpy as np
    >>> from hf_dp_repr.analysis import knn_probe
    >>> rng = np.random.default_rng(0)
    >>> centres = 5 * rng.normal(size=(3, 8))
    >>> y_mem, y_query = rng.integers(0, 3, 300), rng.integers(0, 3, 100)
    >>> x_mem = centres[y_mem] + rng.normal(size=(300, 8))
    >>> x_query = centres[y_query] + rng.normal(size=(100, 8))
    >>> knn_probe(x_mem, y_mem, x_query, y_query)
    1.0
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ArgumentError, DataError
from ._checks import as_float64_matrix, as_int_labels

__all__ = ["knn_predict", "knn_probe"]


def knn_predict(
    memory_features: Any,
    memory_labels: Any,
    query_features: Any,
    *,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
    num_classes: int | None = None,
) -> torch.Tensor:
    """Predicted class id (int64 tensor) per query row; ties between classes go to the smaller class id.

    `k` is capped at the memory size; queries are processed `chunk_size` rows at a time, so memory is
    O(chunk_size · n_memory). `num_classes`: the declared number of classes (e.g. the dataset's ClassLabel);
    memory labels outside 0..num_classes-1 are refused. Without it, the vote has max(memory label) + 1 slots
    (classes absent from the memory get no vote either way, so predictions do not depend on it).
    """
    if k < 1:
        raise ArgumentError(f"`k` must be ≥ 1, got {k}")
    if temperature <= 0:
        raise ArgumentError(f"`temperature` must be > 0, got {temperature}")
    memory = as_float64_matrix(memory_features, "memory_features")
    queries = as_float64_matrix(query_features, "query_features").to(memory.device)
    labels = as_int_labels(memory_labels, memory.shape[0], "memory_labels", device=memory.device)
    if queries.shape[1] != memory.shape[1]:
        raise DataError(f"`query_features` has {queries.shape[1]} dims but `memory_features` has "
                        f"{memory.shape[1]}; extract both from the same layer")
    if bool((labels < 0).any()):
        raise DataError("`memory_labels` must be non-negative class ids")
    if num_classes is not None and int(labels.max()) >= num_classes:
        raise DataError(f"`memory_labels` holds class {int(labels.max())}, outside the declared num_classes="
                        f"{num_classes} (ids 0..{num_classes - 1}); pass the right num_classes")
    memory = torch.nn.functional.normalize(memory, dim=1)
    queries = torch.nn.functional.normalize(queries, dim=1)
    num_classes = num_classes if num_classes is not None else int(labels.max()) + 1
    k = min(k, memory.shape[0])
    predictions = []
    for start in range(0, queries.shape[0], chunk_size):
        sims, idx = (queries[start : start + chunk_size] @ memory.T).topk(k, dim=1)
        votes = sims.new_zeros(sims.shape[0], num_classes)
        votes.scatter_add_(1, labels[idx], (sims / temperature).exp())
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions)


def knn_probe(
    memory_features: Any,
    memory_labels: Any,
    query_features: Any,
    query_labels: Any,
    *,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
) -> float:
    """Top-1 accuracy of the weighted kNN classifier (see module docstring) on the query set."""
    predictions = knn_predict(memory_features, memory_labels, query_features, k=k, temperature=temperature,
                              num_classes=num_classes)
    truth = as_int_labels(query_labels, predictions.shape[0], "query_labels", device=predictions.device)
    return float((predictions == truth).double().mean())
