"""One way into every recipe: `recipes/*.py`, `hf-dp-repr train X` / `synth` and `python -m hf_dp_repr.scripts.X`
all call `run_recipe(name)` (or `run_command(main)`), so they take the same arguments and fail the same way: what a
recipe refuses before any work is one line on stderr, exit code 2 for an argument (`ArgumentError`, as argparse's
own), 1 for data or a model that cannot be found or read (`DataError`, `ModelFileError`); every other error keeps its
traceback. `--help` prints the recipe's saved usage (`scripts/usage/NAME.txt`, DP arguments first) without importing
torch or transformers: it answers at once; `--help-all` adds the help of every Trainer argument.

This module imports nothing heavy: the recipe's module is imported only to run it.

    >>> from hf_dp_repr.scripts.runner import run_recipe
    >>> run_recipe("image_classification", "hf-dp-repr train image", ["--traget_epsilon", "1"])
    2
"""

from __future__ import annotations

import contextvars
import importlib
import os
import sys

from hf_dp_repr.errors import ArgumentError, DataError, ModelFileError

# the command's name while a recipe runs, for its usage line (`usage: hf-dp-repr train image ...`)
PROG: contextvars.ContextVar[str | None] = contextvars.ContextVar("recipe_prog", default=None)


def run_recipe(name: str, prog: str | None = None, argv: list[str] | None = None) -> int:
    """Run `hf_dp_repr.scripts.<name>.main(argv)` as a command (see the module's docstring); returns the exit code."""
    from .usage import print_saved_usage

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0])
    if ("-h" in argv or "--help" in argv) and print_saved_usage(name, prog):
        return 0
    return run_command(importlib.import_module(f"hf_dp_repr.scripts.{name}").main, prog, argv)


def run_command(main, prog: str | None = None, argv: list[str] | None = None) -> int:
    """Run a recipe's `main(argv)` as a command: its refusals as one line and an exit code (the module's docstring)."""
    prog = prog or os.path.basename(sys.argv[0])
    token = PROG.set(prog)
    try:
        main(argv)
    except (ArgumentError, DataError, ModelFileError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ArgumentError) else 1
    finally:
        PROG.reset(token)
    return 0
