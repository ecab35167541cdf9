"""One runner for every recipe (hf_dp_repr.scripts.runner): each recipes/*.py goes through it, so a mistyped or
abbreviated flag is one line and exit code 2 everywhere; `--help` reads as the command that was called, lists the
DP arguments first and answers from the saved usage (scripts/usage/*.txt), which must match the arguments."""

import ast
import runpy
from pathlib import Path

import pytest

from hf_dp_repr.cli import main as cli
from hf_dp_repr.scripts import usage
from hf_dp_repr.scripts.runner import run_command, run_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.py"))


def _main_block_call(path: Path) -> ast.Call:
    """The call in `raise SystemExit(...)` of the file's `if __name__ == "__main__":` block."""
    block = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.If) and "__main__" in ast.unparse(n))
    raised = [n for n in block.body if isinstance(n, ast.Raise)]
    assert raised and isinstance(raised[0].exc, ast.Call), f"{path.name}: raise SystemExit(run_recipe(...)) expected"
    return raised[0].exc.args[0]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_goes_through_the_runner_and_a_mistyped_flag_is_one_line(path, capsys):
    call = _main_block_call(path)
    runner = call.func.id
    assert runner in ("run_recipe", "run_command"), path.name
    try:
        if runner == "run_recipe":
            code = run_recipe(call.args[0].value, "recipe", ["--output_dir", "x", "--no_such_flag", "1"])
        else:  # a recipe whose main is in its own file (an argparse parser): the same runner
            code = run_command(runpy.run_path(str(path))["main"], "recipe", ["--no_such_flag", "1"])
    except SystemExit as exit_:  # argparse's own refusal (CommandParser): also one line, exit code 2
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "error: unrecognized argument --no_such_flag" in err


@pytest.mark.parametrize("name", usage.SAVED)
def test_the_saved_usage_is_what_the_arguments_give(name):
    saved = (usage.USAGE_DIR / f"{name}.txt").read_text()
    assert saved == usage.recipe_usage(name), f"run `python -m hf_dp_repr.scripts.usage` to save {name}'s usage again"


def test_help_reads_as_the_subcommand_and_lists_the_dp_arguments_first(capsys):
    assert cli(["train", "image", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: hf-dp-repr train image [")
    assert text.index("--target_epsilon") < text.index("--model_name_or_path") < text.index("--learning_rate")
    assert "--learning_rate LEARNING_RATE" not in text  # the Trainer's arguments by name; their help: --help-all
    assert len(text.splitlines()) < 400
    assert cli(["synth", "--help"]) == 0 and capsys.readouterr().out.startswith("usage: hf-dp-repr synth [")


def test_help_all_gives_every_trainer_argument_its_help(capsys):
    from hf_dp_repr.scripts.image_classification import main

    with pytest.raises(SystemExit):
        run_command(main, "hf-dp-repr train image", ["--help-all"])
    text = capsys.readouterr().out
    assert text.startswith("usage: hf-dp-repr train image [")
    assert "--learning_rate LEARNING_RATE" in text and text.index("--target_epsilon") < text.index("--learning_rate")


@pytest.mark.parametrize("argv, expected", [
    (["train", "text", "--target_epsilo", "1"],
     "unrecognized argument --target_epsilo; did you mean --target_epsilon?"),
    (["privacy", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1",
      "--accountan", "rdp"], "unrecognized argument --accountan; did you mean --accountant?"),
])
def test_abbreviations_are_refused(argv, expected, capsys):
    try:
        code = cli(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and expected in err and err.count("\n") == 1, err
