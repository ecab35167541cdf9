"""Every ```python block of README.md and docs/*.md runs as shown (offline, CPU), each in a fresh namespace in a
temporary folder. A block marked ```python notest is skipped; the line above it says why (e.g. a GPU, the Hub).
A block that trains runs with tiny settings: its `num_train_epochs=N` becomes `max_steps=3` (what it prints is then
not what the page says, only that it runs). Identical blocks (the quick start is in the README and in
docs/getting-started.md) run once."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def blocks():
    seen, out = set(), []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            info, code = match[1].split(), match[2]
            if "notest" in info or code in seen:
                continue
            seen.add(code)
            line = text.count("\n", 0, match.start()) + 1
            out.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}"))
    return out


def test_the_docs_have_examples():
    assert len(blocks()) >= 10


@pytest.mark.parametrize("code", blocks())
def test_python_block_runs(code, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = re.sub(r"num_train_epochs=\d+", "max_steps=3", code)
    exec(compile(tiny, "<docs block>", "exec"), {"__name__": "__docs__"})


def test_notest_blocks_say_why():
    """A skipped block has its reason on the line above (an HTML comment or text)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if re.match(r"```python\s+notest", line):
                assert i > 0 and lines[i - 1].strip(), f"{path.name}:{i + 1}: say why above a notest block"
