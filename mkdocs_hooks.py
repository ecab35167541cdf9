"""MkDocs hook: a ```python notest fence (a block the docs test skips, tests/test_docs_examples.py) renders as a
plain ```python block; SuperFences would otherwise not take the extra word for a fence. Also the griffe extension
the API reference reads the docstrings with (`ApiReference`, named in mkdocs.yml)."""

import re

NOTEST = re.compile(r"^(\s*```+\s*python)\s+notest\b.*$", re.MULTILINE)


def on_page_markdown(markdown, **kwargs):
    return NOTEST.sub(r"\1", markdown)


# ---- the API reference (griffe, mkdocstrings' reader) -----------------------------------------------------------
import ast  # noqa: E402

from griffe import Docstring, Extension  # noqa: E402

EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ApiReference(Extension):
    """What the API reference needs from the docstrings, without changing them:

    - an `Example:` heading is read as Google style's `Examples:`, so its `>>>` lines render as code (as an
      admonition they rendered as three nested quotes, the lines run together);
    - a dataclass field documented by `field(metadata={"help": ...})` (HfArgumentParser's help, DPTrainingArguments')
      gets that help as its docstring, so the reference lists the fields with their help.
    """

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)

    def on_attribute_instance(self, *, node, attr, **kwargs) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
            return
        for keyword in node.value.keywords:
            if keyword.arg in ("default", "default_factory"):  # shown as the value instead of the field() call
                attr.value = ast.unparse(keyword.value) + ("()" if keyword.arg == "default_factory" else "")
            if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
                for key, value in zip(keyword.value.keys, keyword.value.values):
                    if isinstance(key, ast.Constant) and key.value == "help":
                        text = value.value if isinstance(value, ast.Constant) else ast.unparse(value)
                        attr.docstring = Docstring(str(text), parent=attr)
