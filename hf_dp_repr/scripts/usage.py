"""A recipe's `--help`: its usage line as the command was called (`usage: hf-dp-repr train image ...`), then the
DP-SGD arguments, the recipe's own, TRL's config fields (sft, dpo), and last the Trainer's (`TrainingArguments`: by
name only; `--help-all` gives their help too).

Building it needs the dataclasses, so transformers and torch (seconds to import); `--help` reads the text saved in
`scripts/usage/NAME.txt` instead, which answers at once. `python -m hf_dp_repr.scripts.usage` writes those files
again; tests/test_recipe_runner.py fails when one differs from what the recipe's arguments give today.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import textwrap
from pathlib import Path

USAGE_DIR = Path(__file__).resolve().parent / "usage"
PROG = "{prog}"  # in the saved files, replaced by the command's name when printed
SAVED = ("image_classification", "text_classification", "causal_lm", "synth", "sft", "dpo")  # the HfArgumentParser
# recipes (the others parse with argparse and import nothing heavy before their own --help)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """A fixed width, whatever the terminal: the saved text is the same on every machine."""

    def __init__(self, prog):
        super().__init__(prog, width=100, max_help_position=34)


def print_saved_usage(name: str, prog: str) -> bool:
    """Print `name`'s saved usage with `prog` as the command; False when there is none (the recipe prints its own)."""
    path = USAGE_DIR / f"{name}.txt"
    if not path.exists():
        return False
    print(path.read_text().replace(PROG, prog), end="")
    return True


def usage_text(dataclass_types, prog: str, description: str = "", full: bool = False) -> str:
    """The help of a recipe parsing `dataclass_types` with HfArgumentParser, DP arguments first (the module's
    docstring); `full`: the Trainer's arguments with their help too."""
    from transformers import HfArgumentParser, TrainingArguments

    from hf_dp_repr.training.arguments import DPTrainingArguments

    actions = {}  # dest → [actions]: a bool field defaulting to True also has its --no_ form
    for action in HfArgumentParser(dataclass_types)._actions:
        if action.option_strings and action.dest != "help":
            actions.setdefault(action.dest, []).append(action)
    trainer = [f.name for f in dataclasses.fields(TrainingArguments)]
    dp = [f.name for f in dataclasses.fields(DPTrainingArguments) if f.name not in trainer]
    groups = []
    for cls in dataclass_types:
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if issubclass(cls, TrainingArguments):
            own = [n for n in names if n not in trainer and n not in dp]
            groups = [("DP-SGD arguments (DPTrainingArguments)", dp)] + groups
            if own:
                groups.append((f"{cls.__name__}'s own arguments (the TRL config it extends)", own))
        else:
            groups.append((f"{cls.__name__}", names))
    groups.append(("Trainer arguments (transformers.TrainingArguments, as in Hugging Face's example scripts)",
                   trainer))

    parser = argparse.ArgumentParser(prog=prog, add_help=False, description=description,
                                     formatter_class=_Formatter,
                                     usage=f"{prog} [--config FILE.yaml] [--OPTION VALUE ...]")
    parser.add_argument("-h", "--help", action="store_true", help="this message; --help-all: every Trainer "
                        "argument's help too. Every option also takes dashes: --target-epsilon")
    for title, names in groups:
        compact = title.startswith("Trainer") and not full
        if compact:  # their names (each also takes dashes: --learning-rate), their help on demand
            options = " ".join(a.option_strings[0] for n in names for a in actions.get(n, [])[:1])
            parser.add_argument_group(title, textwrap.fill(options, 116, break_on_hyphens=False)
                                      + "\n(their help: --help-all)")
            continue
        group = parser.add_argument_group(title)
        for name in names:
            for action in actions.get(name, []):
                default = "" if action.default in (None, dataclasses.MISSING) or action.option_strings[0].startswith(
                    "--no_") else f" (default: {action.default})"
                shape = dict(action="store_true") if action.nargs == 0 else dict(
                    metavar=action.metavar or name.upper(), nargs=action.nargs)  # a flag, or one taking values
                group.add_argument(action.option_strings[0], dest=action.option_strings[0], **shape,
                                   help=((action.help or "") + default).replace("%", "%%") or None)
    return parser.format_help()


def recipe_usage(name: str, prog: str = PROG, full: bool = False) -> str:
    """`usage_text` of `hf_dp_repr.scripts.<name>` (imports it)."""
    module = importlib.import_module(f"hf_dp_repr.scripts.{name}")
    description = (module.__doc__ or "").strip().split("\n\n")[0]
    return usage_text(module.ARGUMENT_TYPES, prog, description, full)


def write_saved_usages() -> list[Path]:
    """Write `scripts/usage/NAME.txt` for every recipe of `SAVED`."""
    USAGE_DIR.mkdir(exist_ok=True)
    written = []
    for name in SAVED:
        path = USAGE_DIR / f"{name}.txt"
        path.write_text(recipe_usage(name))
        written.append(path)
    return written


if __name__ == "__main__":
    print("\n".join(str(p) for p in write_saved_usages()))
