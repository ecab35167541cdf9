"""Module paths from before the package was arranged by pipeline stage (issue 24) still import, for one release:
each warns DeprecationWarning naming its new path and is the new module itself (`hf_dp_repr/_moved.py`)."""

import importlib
import pickle
import sys
import warnings

import pytest

from hf_dp_repr._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", __file__, "exec"), {})  # an import statement of this file
    module = sys.modules[old]
    assert module is new
    assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]  # its own identity, kept
    moved = [w for w in seen if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(moved) == 1 and f"moved to {MOVED[old]}" in str(moved[0].message)
    assert moved[0].filename == __file__  # attributed to the importing line, not to the import machinery


def test_from_import_and_attributes_of_an_old_path():
    sys.modules.pop("hf_dp_repr.config", None)
    with pytest.warns(DeprecationWarning, match="hf_dp_repr.config moved to hf_dp_repr.training.arguments"):
        from hf_dp_repr.config import DPTrainingArguments
    from hf_dp_repr.training.arguments import DPTrainingArguments as new

    assert DPTrainingArguments is new


def test_an_object_pickled_under_an_old_path_loads():
    """An old checkpoint's training_args.bin names the class by its old module."""
    from hf_dp_repr.training.arguments import DPTrainingArguments

    blob = pickle.dumps(DPTrainingArguments, protocol=0)
    assert b"hf_dp_repr.training.arguments" in blob
    sys.modules.pop("hf_dp_repr.config", None)
    with pytest.warns(DeprecationWarning):
        assert pickle.loads(blob.replace(b"hf_dp_repr.training.arguments", b"hf_dp_repr.config")) is DPTrainingArguments


def test_unknown_paths_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hf_dp_repr.no_such_module")


def test_names_served_for_another_module_warn_and_are_the_same_objects():
    from hf_dp_repr.privacy import accounting, ledger

    for name in ("LEDGER_FILE", "Phase", "PrivacyLedger", "PrivacyPlan"):
        with pytest.warns(DeprecationWarning, match=f"accounting.{name} moved to hf_dp_repr.privacy.ledger.{name}"):
            assert getattr(accounting, name) is getattr(ledger, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        accounting.nothing
