"""One way to do each thing (issue 14, item 11): each of these fails if a second way comes back."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_dp_repr"


def _trees():
    """(path relative to the package, parsed module) of every module of the package."""
    return [(str(f.relative_to(PACKAGE)), ast.parse(f.read_text())) for f in sorted(PACKAGE.rglob("*.py"))]


def _enclosing_functions(tree):
    """{node: name of the innermost function that contains it} for every node of `tree`."""
    owner = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            owner[child] = name
            visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name)

    visit(tree, None)
    return owner


def test_peft_detection_has_one_home():
    """`hasattr(model, "peft_config")` and `isinstance(model, PeftModel)` only inside scope/lora.py's two helpers."""
    found = []
    for path, tree in _trees():
        owner = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2):
                continue
            arg = node.args[1]
            if ((node.func.id == "hasattr" and isinstance(arg, ast.Constant) and arg.value == "peft_config")
                    or (node.func.id == "isinstance" and "PeftModel" in ast.unparse(arg))):
                found.append((path, owner[node]))
    assert sorted(found) == [("scope/lora.py", "has_peft_adapters"), ("scope/lora.py", "is_peft_model")]


def test_per_parameter_dp_attributes_are_listed_once():
    from hf_dp_repr.privacy.attributes import PER_PARAMETER_ATTRIBUTES

    names = set(PER_PARAMETER_ATTRIBUTES)
    lists, deletions = [], []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                if len({e.value for e in node.elts if isinstance(e, ast.Constant)} & names) >= 2:
                    lists.append(path)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "delattr":
                deletions.append(path)
    assert lists == ["privacy/attributes.py"] and deletions == ["privacy/attributes.py"]


def test_grad_samplers_are_registered_by_every_module_that_hooks_a_model_and_twice_is_harmless():
    code = (
        "import hf_dp_repr.privacy.engine\n"
        "from opacus.grad_sample import GradSampleModule\n"
        "from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import "
        "GradSampleModuleFastGradientClipping as F\n"
        "from transformers.pytorch_utils import Conv1D\n"
        "from hf_dp_repr.privacy.grad_samplers import HF_GRAD_SAMPLERS, register_grad_samplers\n"
        "from hf_dp_repr.privacy.modules.linear import conv1d_grad_sample\n"
        "assert GradSampleModule.GRAD_SAMPLERS[Conv1D] is conv1d_grad_sample is F.GRAD_SAMPLERS[Conv1D]\n"
        "before = dict(GradSampleModule.GRAD_SAMPLERS)\n"
        "register_grad_samplers(); register_grad_samplers()\n"
        "assert GradSampleModule.GRAD_SAMPLERS == before\n"
        "assert all(GradSampleModule.GRAD_SAMPLERS[c] is r for c, r in HF_GRAD_SAMPLERS.items())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_every_module_that_hooks_a_model_loads_the_module_rules():
    """The rules register as privacy.modules loads: each privacy module that uses Opacus' hooks or rule registry
    imports it (so it is loaded before a model is hooked), and nothing else calls register_grad_samplers."""
    missing, callers = [], []
    for path, tree in _trees():
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if path in ("privacy/grad_samplers.py", "privacy/ghost_rules.py", "privacy/modules/__init__.py"):  # registries
            continue
        if path.startswith("privacy/") and not path.startswith("privacy/modules/") \
                and names & {"GradSampleHooks", "GRAD_SAMPLERS", "GhostClippingEngine"} \
                and not _imports_module_rules(tree):
            missing.append(path)
        if "register_grad_samplers" in names:
            callers.append(path)
    assert missing == [] and callers == []


def _imports_module_rules(tree) -> bool:
    """`from . import modules` or `from .modules... import ...` anywhere in a privacy module."""
    return any(isinstance(n, ast.ImportFrom) and n.level == 1 and (
        (n.module or "").split(".")[0] == "modules" or (n.module is None and any(a.name == "modules" for a in n.names)))
        for n in ast.walk(tree))


def _imports(tree) -> set[str]:
    """Modules of the package a parsed module imports anywhere (module level or inside functions), absolute."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith(("hf_dp_repr", "."))}


def test_embedded_datasets_have_one_loader_and_no_import_cycle():
    """`hf_dp_repr.data` serves every embedded dataset; the stdlib corpus behind it imports nothing of the package
    but its errors, and nothing but data/embedded.py imports it, so data ↔ analysis cannot import each other again."""
    trees = dict(_trees())
    assert not (PACKAGE / "analysis" / "corpus.py").exists()
    assert _imports(trees["data/stdlib_corpus.py"]) <= {"..errors"}  # (errors.py imports nothing)
    assert not {m for m in _imports(trees["data/embedded.py"]) if "analysis" in m or "scripts" in m}
    users = sorted(path for path, tree in trees.items() if any("stdlib_corpus" in m for m in _imports(tree)))
    assert users == ["data/embedded.py"]
    for module in ("hf_dp_repr.analysis.inputs", "hf_dp_repr.data"):  # each alone, in a fresh interpreter
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=PACKAGE.parent)


def test_each_embedded_dataset_name_has_one_meaning():
    """'stdlib-docs' once named paragraphs (the LM recipe) and token blocks (analyze); now each has its own name and
    the old one means paragraphs wherever it is passed."""
    from hf_dp_repr.analysis.analyze_cli import add_analyze_parser
    from hf_dp_repr.data import EMBEDDED_DATASETS, embedded_name, load_embedded
    from hf_dp_repr.scripts.causal_lm import LMArguments

    assert EMBEDDED_DATASETS == ("digits", "stdlib-paragraphs", "stdlib-blocks", "stdlib-topics")
    paragraphs = load_embedded("stdlib-docs")
    assert paragraphs["train"].column_names == ["text"]
    assert paragraphs["train"]["text"] == load_embedded("stdlib-paragraphs")["train"]["text"]
    blocks = load_embedded("stdlib-blocks", block_size=32)
    assert blocks["train"].column_names == ["input_ids", "attention_mask"]
    assert len(blocks["train"][0]["input_ids"]) == 32
    assert embedded_name(LMArguments().dataset_name) == embedded_name("stdlib-docs") == "stdlib-paragraphs"
    import argparse

    analyze = add_analyze_parser(argparse.ArgumentParser().add_subparsers())
    help_text = next(a.help for a in analyze._actions if "--dataset" in a.option_strings)
    assert all(name in help_text for name in EMBEDDED_DATASETS) and "stdlib-docs = stdlib-paragraphs" in help_text
    # The old name lives in one place as a value (the alias table), never as a second meaning elsewhere.
    holders = set()
    for path, tree in _trees():
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        if any(isinstance(n, ast.Constant) and n.value == "stdlib-docs" and id(n) not in docstrings
               for n in ast.walk(tree)):
            holders.add(path)
    assert holders == {"data/embedded.py"}
