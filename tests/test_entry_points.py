"""Every entry point sets up the process in one place (`hf_dp_repr.entry_point`) before torch loads: each
recipes/*.py file, the `hf-dp-repr` command and the recipes' package; the command imports no torch until a command
needs it; tensorboard is an optional extra."""

import ast
import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_dp_repr"
RECIPES = sorted((ROOT / "recipes").glob("*.py"))
LIGHT = {"__future__", "os", "sys", "argparse", "hf_dp_repr.entry_point"}  # may come before the call


def _is_prepare_call(node) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "prepare_entry_point")


def _imported(node) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        return {node.module}
    return {a.name for a in node.names} if isinstance(node, ast.Import) else set()


def _statements_before_the_call(path: Path) -> list:
    body = ast.parse(path.read_text()).body
    calls = [i for i, node in enumerate(body) if _is_prepare_call(node)]
    assert calls, f"{path.name} does not call prepare_entry_point() at module level"
    return body[:calls[0]]


@pytest.mark.parametrize("path", RECIPES + [PACKAGE / "scripts" / "__init__.py"], ids=lambda p: p.name)
def test_each_recipe_and_the_scripts_package_set_up_the_process_before_importing_anything_heavy(path):
    for node in _statements_before_the_call(path):
        assert _imported(node) <= LIGHT, (path.name, ast.unparse(node))


def test_the_command_sets_up_the_process_first_and_imports_no_torch_until_a_command_needs_it():
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert _is_prepare_call(main.body[0])
    code = "import sys, hf_dp_repr.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# When torch is first imported (by the entry point, or after it as the run's work would), record the OpenMP policy
# and thread count the process has at that moment.
SPY = """
import importlib.abc, json, os, runpy, sys
seen = {}
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.update(policy=os.environ.get("OMP_WAIT_POLICY"), threads=os.environ.get("OMP_NUM_THREADS"))
sys.meta_path.insert(0, Spy())
kind, target, *args = sys.argv[1:]
sys.argv = [target, *args]
try:
    runpy.run_path(target, run_name="__main__") if kind == "path" else __import__(target)
except SystemExit:
    pass
import torch  # the work after --help would load it now, if nothing did before
print("SPY" + json.dumps(seen))
"""
CASES = {  # (how, what, arguments, threads expected when torch loads); the command: see the test above
    "seed000_sweep": ("path", str(ROOT / "recipes" / "seed000_sweep.py"), ["--help"], "1"),
    "scripts_package": ("import", "hf_dp_repr.scripts", [], None),  # python -m hf_dp_repr.scripts.NAME, train
}


@pytest.mark.parametrize("case", CASES)
def test_openmp_threads_are_passive_when_torch_loads(case):
    how, target, args, threads = CASES[case]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", SPY, how, target, *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    seen = json.loads(out.stdout.rsplit("SPY", 1)[1])
    assert seen == {"policy": "PASSIVE", "threads": threads}, out.stderr[-3000:]


def test_tensorboard_is_an_optional_extra(monkeypatch, tmp_path):
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "tensorboard" not in cfg["options"]["install_requires"]
    assert "tensorboard" in cfg["options.extras_require"]["tensorboard"]
    import importlib.util

    from hf_dp_repr import DPTrainingArguments
    from hf_dp_repr.errors import DPConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tensorboard") else find_spec(name, *a))
    with pytest.raises(DPConfigError, match=r"hf-dp-repr\[tensorboard\]"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="tensorboard")
    DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="all")  # what is installed
