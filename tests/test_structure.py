"""The package's shape: no import cycles, no arrow back up the pipeline, small modules, a small root."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "hf_dp_repr"
# Rank of each stage (longest dotted prefix wins). An import may go to a lower rank, or stay inside its own stage
# package (those edges must still be acyclic). Stages of equal rank may not import each other.
RANKS = {
    "hf_dp_repr.errors": 0, "hf_dp_repr.quiet": 0, "hf_dp_repr.tiny": 0, "hf_dp_repr.registry": 0.5,  # (uses errors)
    "hf_dp_repr.entry_point": 0, "hf_dp_repr.metrics": 0,
    "hf_dp_repr.data": 1, "hf_dp_repr.scope": 2, "hf_dp_repr.privacy": 3, "hf_dp_repr.hub": 4,
    "hf_dp_repr.training": 5, "hf_dp_repr.analysis": 6, "hf_dp_repr.trl": 6, "hf_dp_repr.audit": 7,
    "hf_dp_repr.tuning": 7, "hf_dp_repr.synth": 7,
    "hf_dp_repr.scripts": 8, "hf_dp_repr.cli": 8,
    "hf_dp_repr": 9,  # the root facade: re-exports and registrations; nothing in the package imports it
}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """Package modules `name` imports, at module level or in functions; `import a.b.c` also runs a and a.b."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
            parts = target.split(".")
            for i in range(1, len(parts)):  # the packages above the target run first, unless they hold `name`
                pkg = ".".join(parts[:i])
                if pkg in known and pkg != name and not name.startswith(pkg + "."):
                    found.add(pkg)
    return {t for t in found if t.startswith("hf_dp_repr")}


def rank(name: str) -> tuple[int, str]:
    prefix = max((p for p in RANKS if name == p or name.startswith(p + ".")), key=len)
    return RANKS[prefix], prefix


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycles():
    g, seen, done, cycles = graph(), [], set(), []

    def visit(node):
        seen.append(node)
        for nxt in sorted(g[node]):
            if nxt in seen:
                cycles.append(seen[seen.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        seen.pop()
        done.add(node)

    for node in sorted(g):
        if node not in done:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_arrow_back_up_the_pipeline():
    bad = []
    for src, targets in graph().items():
        rs, ps = rank(src)
        for dst in targets:
            rd, pd = rank(dst)
            if dst == "hf_dp_repr" or rd > rs or (rd == rs and pd != ps):  # the facade, a higher stage, a peer
                bad.append(f"{src} ({rs}) -> {dst} ({rd})")
    assert not bad, "imports against the stage order:\n" + "\n".join(sorted(bad))


def test_small_modules_and_a_small_root():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {k: n for k, n in sizes.items() if n > 400}
    assert len(list(PACKAGE.glob("*.py"))) <= 8, sorted(p.name for p in PACKAGE.glob("*.py"))


def test_the_core_never_imports_trl():
    """TRL is an optional extra: `import hf_dp_repr` and the training stage (DPTrainer) must not import it."""
    import subprocess
    import sys

    code = ("import sys, hf_dp_repr, hf_dp_repr.training.trainer, hf_dp_repr.training.arguments; "
            "hf_dp_repr.DPTrainer; sys.exit('trl' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent).returncode == 0


def test_every_module_is_placed_in_the_architecture_page():
    """docs/architecture.md's layout names every module of the package on its folder's line(s): a new module is
    placed there (or this fails, naming it)."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    layout = page.split("## Layout", 1)[1].split("```")[1]
    sections, folder = {}, None  # folder (as the page writes it) -> the text of its lines
    for line in layout.splitlines():
        if not line.startswith(" "):  # a new entry: one of the package's folders, or recipes/, docs/, ...
            folder, _, line = line.partition(" ")
            folder = folder if folder.startswith("hf_dp_repr/") else None
        if folder is not None:
            sections[folder] = sections.get(folder, "") + " " + line
    missing = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":  # its folder's line describes the package
            continue
        rel = path.relative_to(PACKAGE.parent)
        folder = "hf_dp_repr/*.py" if rel.parent == pathlib.Path("hf_dp_repr") else f"{rel.parent.as_posix()}/"
        if not re.search(rf"(?<![\w/]){re.escape(path.stem)}(?!\w)", sections.get(folder, "")):
            missing.append(rel.as_posix())
    assert not missing, "modules docs/architecture.md does not place (name each on its folder's line):\n" + "\n".join(
        sorted(missing))
