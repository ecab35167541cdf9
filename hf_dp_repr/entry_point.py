"""What every entry point does first, in one place, before torch loads: each `recipes/*.py` file, the `hf-dp-repr`
command (`cli.main`) and the recipes' package (`hf_dp_repr/scripts/__init__.py`, so `python -m
hf_dp_repr.scripts.image_classification` too) call `prepare_entry_point()` before anything imports torch
(`tests/test_entry_points.py` checks each of them). Importing this module imports nothing heavy.

- `OMP_WAIT_POLICY=PASSIVE` (unless set): OpenMP reads it once, when torch loads its runtime, so it must be set
  before `import torch`. On a CPU shared with other jobs, threads that spin at barriers while other processes hold
  the cores made a MiniLM forward pass 8-12× slower (2 shared cores, load 2-4: 133 s instead of 11 s for 1147
  paragraphs), and the tiny-ViT sweeps (`seed000_sweep.py`, `lp_budget_split.py`) were reported to take 29 min
  instead of 1 min 54 s without it; passive threads sleep instead.
- `TOKENIZERS_PARALLELISM=false` (unless set): no fork warning from the tokenizers' thread pool.
- one intra-op thread for a tiny model on CPU (`one_thread_for_tiny_model`), unless `OMP_NUM_THREADS` says.

`import hf_dp_repr` sets `OMP_WAIT_POLICY=PASSIVE` too when torch is not loaded yet (`passive_openmp_at_import`),
so the Python quick start, pasted as is, is fast; when torch was loaded first with spinning threads, training
warns once, on a loaded machine, naming the fix (`warn_if_openmp_spins`, called as the DP optimizer is made).

The commands' argument errors are one line naming the argument and the closest valid one, exit code 2, as
argparse's (`CommandParser`; a recipe's typed argument errors: `scripts.runner.run_recipe`).

A library user's own script can call it first too:

    >>> import os
    >>> from hf_dp_repr.entry_point import prepare_entry_point
    >>> prepare_entry_point()
    >>> "OMP_WAIT_POLICY" in os.environ and "TOKENIZERS_PARALLELISM" in os.environ
    True
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings


def prepare_entry_point(*, tiny_model: bool = False) -> None:
    """Set the process environment of this module's docstring (values already set win); with `tiny_model`, one
    intra-op thread as well. Call it before anything imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tiny_model:
        one_thread_for_tiny_model()


# The OpenMP wait policy the process had when `import hf_dp_repr` found torch already loaded (None: torch loaded
# after, under the policy the environment has then).
_POLICY_AT_TORCH_LOAD: list[str | None] = []
_WARNED_SPINNING: list[bool] = []


def passive_openmp_at_import() -> None:
    """`import hf_dp_repr`: before torch loads, OMP_WAIT_POLICY=PASSIVE unless set (OpenMP reads it once, when torch
    loads); after, remember the policy torch was loaded under, for `warn_if_openmp_spins`."""
    if "torch" in sys.modules:
        _POLICY_AT_TORCH_LOAD[:] = [os.environ.get("OMP_WAIT_POLICY")]
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def openmp_threads_spin() -> bool:
    """True when torch runs several intra-op threads under OpenMP's spinning (non-PASSIVE) wait policy."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    policy = _POLICY_AT_TORCH_LOAD[0] if _POLICY_AT_TORCH_LOAD else os.environ.get("OMP_WAIT_POLICY")
    return (policy or "").upper() != "PASSIVE" and torch.get_num_threads() > 1


def warn_if_openmp_spins() -> bool:
    """Warn once per process when training starts with spinning OpenMP threads on a loaded machine (the 1-minute
    load average at least half the cores): there each step was up to 12× slower. Returns whether it warned."""
    if _WARNED_SPINNING or not openmp_threads_spin() or not hasattr(os, "getloadavg"):
        return False
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < cores / 2:
        return False
    _WARNED_SPINNING.append(True)
    warnings.warn(
        f"torch was loaded with OpenMP threads that spin at barriers (OMP_WAIT_POLICY is not PASSIVE, "
        f"{sys.modules['torch'].get_num_threads()} threads) on a loaded machine (load {load:.1f} on {cores} cores): "
        "training can be up to 12× slower. Fix: `import hf_dp_repr` before `import torch` (it sets "
        "OMP_WAIT_POLICY=PASSIVE), or start Python with OMP_WAIT_POLICY=PASSIVE.", RuntimeWarning, stacklevel=2)
    return True


def one_thread_for_tiny_model() -> None:
    """A tiny model on CPU gains nothing from intra-op threads, and on a busy machine OpenMP threads spinning at
    barriers made each step up to 10× slower (measured, 2 shared cores): use one, unless OMP_NUM_THREADS says.
    Before torch loads this sets OMP_NUM_THREADS=1 (read when torch loads); after, `torch.set_num_threads(1)`."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch = sys.modules.get("torch")
    if torch is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    elif not torch.cuda.is_available():
        torch.set_num_threads(1)


# ---- command-line errors -----------------------------------------------------------------------------------------
def closest(word: str, valid) -> str | None:
    """The valid name closest to `word` (a typo), or None when none is close."""
    found = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, valid) -> str:
    """"; did you mean X?" for the valid name closest to `word`, or a pointer to --help."""
    near = closest(word, valid)
    return f"; did you mean {near}?" if near else " (--help lists them)"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every --option of `parser` and of the subcommands built into it."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= option_strings(sub)
    return out


class CommandParser(argparse.ArgumentParser):
    """argparse, with a one-line error that names the argument and the closest valid one (exit code 2), and no
    abbreviated options.

        >>> p = CommandParser(prog="demo"); _ = p.add_argument("--target_epsilon", type=float)
        >>> p.parse_args(["--traget_epsilon", "3"])
        Traceback (most recent call last):
        SystemExit: 2
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):  # --target_epsilo is a typo, not an option
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\n")

    def explain(self, message: str) -> str:
        if message.startswith("unrecognized arguments: "):
            unknown = [a.split("=", 1)[0] for a in message.split(": ", 1)[1].split() if a.startswith("-")]
            if unknown:
                valid = option_strings(self)
                return "; ".join(f"unrecognized argument {a}{did_you_mean(a, valid)}" for a in unknown)
        if match := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            valid = re.findall(r"'([^']*)'", match.group(2))
            near = closest(match.group(1), valid)
            return (message.split(" (choose from")[0] + (f"; did you mean {near!r}?" if near else "")
                    + f" (one of: {', '.join(valid)})")
        return message

