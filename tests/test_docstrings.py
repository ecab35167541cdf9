"""The runnable examples in the package's docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import hf_dp_repr

MODULES = sorted(m.name for m in pkgutil.walk_packages(hf_dp_repr.__path__, "hf_dp_repr."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (see the output above)"
