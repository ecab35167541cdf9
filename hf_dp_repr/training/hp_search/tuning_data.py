"""Which data a hyperparameter search tuned on, checked against the data DP runs train on.

The mode must be given (`check_tuning_data_stated`): the trials train on the trainer's `train_dataset`, which a
DPTrainer holds as its private training set, so a search that does not say otherwise would tune on private data
without accounting for it (its best trial's card would state the trial's ε alone). `tuning_data="public"` or
`"held_out"` states that the trials' training set is not the private set a DP model
protects, so the search is charged to no budget. That is checked, by dataset fingerprint (`datasets`'
`_fingerprint`, or a hash of the rows for other datasets):

- a public or held-out search on data that a DP run (or a private search) of this process trained on is refused
  (the search would tune on private data without accounting for it);
- a DP run on data that the same trainer's search tuned on is refused, whatever the mode: its card would state the
  run's ε alone, while its hyperparameters were chosen on that data (after a private search, the release the
  search's ε covers is the best trial itself, `output_dir/best_trial`).

Both errors are `TuningDataError`, raised before any work. Example:
    >>> from datasets import Dataset
    >>> from hf_dp_repr.training.hp_search.tuning_data import fingerprint
    >>> rows = Dataset.from_dict({"x": [1, 2, 3]})
    >>> fingerprint(rows) == fingerprint(rows) != fingerprint(rows.select([0, 1]))
    True
"""

from __future__ import annotations

import weakref

from ...errors import TuningDataError

_TRAINED: set[str] = set()  # fingerprints of the datasets DP runs of this process trained on (outside a search)
_TRAINED_LATER: list = []  # weak references to other trained datasets: hashed only if a search needs it


def fingerprint(dataset) -> str:
    """`datasets.Dataset._fingerprint`, or a hash of every row (for a torch dataset, a list, ...)."""
    found = getattr(dataset, "_fingerprint", None)
    if isinstance(found, str):
        return found
    from datasets.fingerprint import Hasher

    hasher = Hasher()
    for i in range(len(dataset)):
        hasher.update(dataset[i])
    return "rows:" + hasher.hexdigest()


def check_tuning_data_stated(tuning_data: str | None, dataset) -> None:
    """Before a search: refuse one that does not say what its trials train on (`tuning_data` None)."""
    if tuning_data is not None:
        return
    rows = f" ({len(dataset)} rows)" if hasattr(dataset, "__len__") else ""
    raise TuningDataError(
        f"hyperparameter_search: tuning_data is not given, and the trials would train on this trainer's "
        f"train_dataset{rows}, which DPTrainer holds as the private training set: a search on it that is not "
        "accounted is covered by no ε (the best trial's card would state its own ε alone). Fix: "
        "tuning_data='private' (the whole search is accounted, Papernot & Steinke: with "
        "trial_count=TrialCount.geometric(0.1) and eval_data_public=True), or give the trainer a public tuning set "
        "(or individuals held out from the private set) as train_dataset and say so: tuning_data='public' or "
        "'held_out'.")


def check_search_data(dataset, tuning_data: str) -> str:
    """Before a search: refuse public/held-out tuning on data a DP run of this process trained on (a private search
    marks its data so). Returns the dataset's fingerprint."""
    key = fingerprint(dataset)
    if tuning_data == "private":
        _TRAINED.add(key)
        return key
    if tuning_data != "private" and key in _trained_fingerprints():
        raise TuningDataError(
            f"hyperparameter_search(tuning_data={tuning_data!r}): the trials' training set is the private training "
            "set of an earlier DP run in this process (same dataset fingerprint), not public or held-out data; a "
            "search on it is not free. Use tuning_data='private' (the search is then accounted, Papernot & Steinke), "
            "or tune on public data or on individuals held out from the private set.")
    return key


def check_training_data(trainer) -> None:
    """Before a DP run (not a search's trial): refuse data this trainer's search tuned on; remember the data as a
    private training set."""
    dataset = trainer.train_dataset
    if dataset is None:
        return
    searched = getattr(trainer, "_searched_data", None) or {}
    key = fingerprint(dataset) if searched or _has_fingerprint(dataset) else None
    mode = searched.get(key) if key is not None else None
    if mode == "private":
        raise TuningDataError(
            "DPTrainer.train: this trainer's hyperparameter_search(tuning_data='private') tuned on this training "
            "set; its ε covers releasing the best trial (output_dir/best_trial, already trained), not a new run "
            "on the same data with hyperparameters chosen on it. Release the best trial, or train on other data.")
    if mode is not None:
        raise TuningDataError(
            f"DPTrainer.train: this trainer's hyperparameter_search(tuning_data={mode!r}) tuned on this training set, "
            f"so it was not {mode} data: this run's card would state its ε without the search's. Search again with "
            "tuning_data='private' (accounted; release its best trial), or tune on public or held-out data.")
    if key is not None:
        _TRAINED.add(key)
    else:
        try:
            _TRAINED_LATER.append(weakref.ref(dataset))
        except TypeError:  # a list, ...: hashed now
            _TRAINED.add(fingerprint(dataset))


def forget() -> None:
    """Forget the private training sets seen in this process (for tests: each test is a process of its own)."""
    _TRAINED.clear()
    _TRAINED_LATER.clear()


def _has_fingerprint(dataset) -> bool:
    return isinstance(getattr(dataset, "_fingerprint", None), str)


def _trained_fingerprints() -> set[str]:
    for ref in _TRAINED_LATER:
        if (dataset := ref()) is not None:
            _TRAINED.add(fingerprint(dataset))
    _TRAINED_LATER.clear()
    return _TRAINED
