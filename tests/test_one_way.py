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
    """`hasattr(model, "peft_config")` and `isinstance(model, PeftModel)` only inside lora.py's two helpers."""
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
    assert sorted(found) == [("lora.py", "has_peft_adapters"), ("lora.py", "is_peft_model")]


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


def test_grad_samplers_are_registered_by_importing_the_package_and_twice_is_harmless():
    code = (
        "import hf_dp_repr\n"
        "from opacus.grad_sample import GradSampleModule\n"
        "from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping as F\n"
        "from transformers.pytorch_utils import Conv1D\n"
        "from hf_dp_repr.privacy.grad_samplers import HF_GRAD_SAMPLERS, conv1d_grad_sample, register_grad_samplers\n"
        "assert GradSampleModule.GRAD_SAMPLERS[Conv1D] is conv1d_grad_sample is F.GRAD_SAMPLERS[Conv1D]\n"
        "before = dict(GradSampleModule.GRAD_SAMPLERS)\n"
        "register_grad_samplers(); register_grad_samplers()\n"
        "assert GradSampleModule.GRAD_SAMPLERS == before\n"
        "assert all(GradSampleModule.GRAD_SAMPLERS[c] is r for c, r in HF_GRAD_SAMPLERS.items())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_no_module_imports_grad_samplers_for_a_side_effect():
    """Only privacy/__init__.py registers; other modules import names they use from grad_samplers, or nothing."""
    bare = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "grad_samplers" for a in node.names):
                bare.append(path)
    assert bare == []
