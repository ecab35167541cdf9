"""MkDocs hook: a ```python notest fence (a block the docs test skips, tests/test_docs_examples.py) renders as a
plain ```python block; SuperFences would otherwise not take the extra word for a fence."""

import re

NOTEST = re.compile(r"^(\s*```+\s*python)\s+notest\b.*$", re.MULTILINE)


def on_page_markdown(markdown, **kwargs):
    return NOTEST.sub(r"\1", markdown)
