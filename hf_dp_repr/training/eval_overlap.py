"""Evaluation sets that share rows with the training set (`check_eval_overlap`, `metric_prefix`: used by
`DPTrainer` at init, train, evaluate and predict).

Metrics of an evaluation set taken from the training data (their losses, predictions, accuracy) are statistics of
the private data computed outside DP-SGD: the DP guarantee covers the weights, not them. `DPTrainer` checks each
set it evaluates against the training set (`shared_rows`): the same object or `datasets` fingerprint, else hashes
of rows over their common columns, for any dataset whose rows are dicts (a `datasets.Dataset`, a torch `Dataset`;
tensors, arrays and lists compared by value, floats at float32 precision), every row up to `MAX_HASHED_ROWS` per
set; past that, evenly spaced rows, so a small overlap of very large sets can go unnoticed. Rows that are not dicts
cannot be compared (`Overlap.private` is None): `probe_preconditioning` refuses such a public set.

- The same set, or at least `PRIVATE_SHARE` of its checked rows equal to training rows (a set drawn from the
  training data: a copy, a selection, train + test concatenated): private. It warns, and names that set's metrics
  `train_eval_*` (`train_` + the usual prefix): like every `train_*` metric they stay out of the metrics files, the
  model card and every push (`hf_dp_repr.hub.is_private_metric`). Choosing the released checkpoint by them
  (`load_best_model_at_end`) or when to stop (`metric_for_best_model`, early stopping) would make the released
  model a non-private function of the training data: refused before any work.
- A few equal rows (duplicates across splits, or texts equal once truncated to max_length): warned, metrics kept.
  A held-out copy of a training row is a row of its own (removing the training row leaves it in the eval set);
  drop such rows if they were taken from the training data.

Example (a selection of the training set under a new fingerprint is found):
    >>> import datasets
    >>> train = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "label": [0, 1, 0]})
    >>> shared_rows(train, train.select([2, 0]))
    Overlap(description='all 2 rows checked are training rows', private=True)
    >>> shared_rows(train, datasets.Dataset.from_dict({"x": [[7.0, 8.0]], "label": [1]})) is None
    True
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import NamedTuple

import datasets
import numpy as np
from transformers.utils import logging

from ..errors import DPConfigError
from ..hub.public_names import PRIVATE_PREFIX  # `train_*` metrics: kept out of files, cards and pushes
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)
MAX_HASHED_ROWS = 50_000
PRIVATE_SHARE = 0.1  # of the checked eval rows equal to training rows: the set was drawn from the training data


class Overlap(NamedTuple):
    description: str
    private: bool | None  # its metrics are statistics of the training data (None: its rows could not be compared)


def _canonical(value):
    """`value` in a form equal for equal contents whatever the container: a tensor, an array and a list of the same
    numbers (floats at float32 precision, integers and booleans as int64) give the same bytes."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # ragged nested lists, ...: compared as they are
        return value
    if array.dtype.kind == "f":
        return array.shape, array.astype(np.float32).tobytes()
    if array.dtype.kind in "iub":
        return array.shape, array.astype(np.int64).tobytes()
    return value


def _hash(values: list) -> bytes:
    return hashlib.blake2b(pickle.dumps([_canonical(v) for v in values], protocol=5), digest_size=16).digest()


def _checked_rows(n: int):
    return None if n <= MAX_HASHED_ROWS else np.unique(np.linspace(0, n - 1, MAX_HASHED_ROWS).round().astype(int))


def _row_hashes(dataset, columns: list[str]) -> set[bytes]:
    n = len(dataset)
    rows = _checked_rows(n)
    if not isinstance(dataset, datasets.Dataset):
        return {_hash([dataset[int(i)][c] for c in columns]) for i in (range(n) if rows is None else rows)}
    table = dataset.with_format("arrow", columns=columns)
    hashes = set()
    for start in range(0, n if rows is None else len(rows), 1024):
        batch = table[start:start + 1024] if rows is None else table[rows[start:start + 1024].tolist()]
        hashes.update(_hash([row[c] for c in columns]) for row in batch.to_pylist())
    return hashes


def _columns(dataset) -> list[str] | None:
    """The columns of a dataset of dict rows (a `datasets.Dataset`'s, or the first row's keys), else None."""
    if isinstance(dataset, datasets.Dataset):
        return dataset.column_names
    try:
        first = dataset[0] if len(dataset) else {}
    except (TypeError, KeyError, IndexError, NotImplementedError):  # not a map-style dataset
        return None
    return list(first) if isinstance(first, Mapping) else None


def shared_rows(train, evaluation) -> Overlap | None:
    """How the evaluation set overlaps the training set, or None if no overlap was found."""
    if train is None or evaluation is None:
        return None
    if train is evaluation:
        return Overlap("it is the training set", True)
    fingerprint = getattr(train, "_fingerprint", None)
    if fingerprint is not None and fingerprint == getattr(evaluation, "_fingerprint", None):
        return Overlap("it is the training set (same fingerprint)", True)
    train_columns, eval_columns = _columns(train), _columns(evaluation)
    if train_columns is None or eval_columns is None:
        return Overlap("its rows or the training rows are not dicts, so they cannot be compared", None)
    columns = sorted(set(train_columns) & set(eval_columns))
    if not columns or not len(train) or not len(evaluation):
        return None
    checked = _row_hashes(evaluation, columns)
    found = len(checked & _row_hashes(train, columns))
    if not found:
        return None
    return Overlap(f"all {found} rows checked are training rows" if found == len(checked)
                   else f"{found} of {len(checked)} distinct rows checked are training rows",
                   found >= PRIVATE_SHARE * len(checked))


def _overlap(trainer, dataset) -> Overlap | None:
    """`shared_rows` of the trainer's training set and `dataset`, worked out (and warned about) once per pair."""
    cache = trainer.__dict__.setdefault("_overlap_cache", {})
    train = trainer.train_dataset
    key = (id(train), getattr(train, "_fingerprint", None), id(dataset), getattr(dataset, "_fingerprint", None))
    if key not in cache:
        found = shared_rows(train, dataset)
        found = cache[key] = None if found and found.private is None else found  # not comparable: as before
        if found and found.private:
            logger.warning(f"DPTrainer: the evaluation set overlaps the training set ({found.description}). Its "
                           "metrics are computed on private data outside DP-SGD: they are named train_eval_* "
                           "and kept out of metrics files, the model card and pushes. Evaluate on held-out rows "
                           "to publish them.")
        elif found:
            logger.warning(f"DPTrainer: the evaluation set shares a few rows with the training set "
                           f"({found.description}: duplicates across splits, or rows equal once truncated?). Its "
                           "metrics are kept; if those rows were taken from the training data, drop them.")
    return cache[key]


def check_eval_overlap(trainer) -> None:
    """At init and train(): warn about every eval set that overlaps the training set; refuse selecting the model
    by one."""
    sets = trainer.eval_dataset if isinstance(trainer.eval_dataset, dict) else {None: trainer.eval_dataset}
    args = trainer.args
    metric = args.metric_for_best_model
    metric = metric if metric is None or metric.startswith("eval_") else f"eval_{metric}"
    for name, dataset in sets.items():
        found = _overlap(trainer, dataset)
        if found and found.private and metric is not None and (name is None or metric.startswith(f"eval_{name}_")):
            raise DPConfigError(
                f"DPTrainer: {'the eval_dataset' if name is None else f'eval_dataset[{name!r}]'} overlaps the "
                f"training set ({found.description}), and metric_for_best_model="
                f"{args.metric_for_best_model!r} (load_best_model_at_end={args.load_best_model_at_end}) "
                "would choose the released checkpoint, or when to stop, by metrics of private training rows "
                "computed outside DP-SGD. Evaluate on held-out rows, or drop load_best_model_at_end / "
                "metric_for_best_model (and early stopping).")


def metric_prefix(trainer, dataset, prefix: str) -> str:
    """`evaluate` / `predict`'s metric prefix: `train_<prefix>` for a set drawn from the training data (kept out of
    metrics files, cards and pushes), else `prefix`. `dataset`: a set, or the name of one of the eval sets."""
    if isinstance(dataset, str):
        dataset = trainer.eval_dataset[dataset]
    found = _overlap(trainer, dataset)
    return f"{PRIVATE_PREFIX}{prefix}" if found and found.private else prefix
