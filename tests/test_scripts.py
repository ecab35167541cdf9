"""The recipes' shared code in the package (hf_dp_repr.scripts): one base of script arguments, the --config parser,
the thin recipes/*.py files and `hf-dp-repr train`."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.scripts import arguments, causal_lm, image_classification, text_classification, utils

ROOT = Path(__file__).resolve().parents[1]
RECIPE_ARGUMENTS = [image_classification.ImageArguments, causal_lm.LMArguments, text_classification.TextArguments]


def _declared_in(cls) -> set[str]:
    """Fields a class declares itself (not inherited)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return {f.name for f in dataclasses.fields(cls)} - inherited


def test_every_recipe_shares_one_base_and_repeats_no_shared_field():
    shared = {f.name for f in dataclasses.fields(arguments.ScriptArguments)}
    public = {f.name for f in dataclasses.fields(arguments.PublicPretrainingArguments)}
    for cls in RECIPE_ARGUMENTS:
        assert issubclass(cls, arguments.ScriptArguments), cls
        own = _declared_in(cls)
        # only the defaults that differ are re-declared: the model / dataset, LM's public epochs and analysis size
        assert own & (shared | public) <= {"model_name_or_path", "dataset_name", "public_epochs"}, (cls, own)
    for cls in (image_classification.ImageArguments, causal_lm.LMArguments):
        assert issubclass(cls, arguments.PublicPretrainingArguments)
    assert image_classification.ImageArguments().public_epochs == 40 and causal_lm.LMArguments().public_epochs == 15


def test_public_fraction_default_depends_on_whether_the_model_is_pretrained():
    args = arguments.PublicPretrainingArguments()
    assert args.resolved_public_fraction(tiny=True) == 0.5 and args.resolved_public_fraction(tiny=False) == 0.0
    assert arguments.PublicPretrainingArguments(public_fraction=0.2).resolved_public_fraction(tiny=True) == 0.2


def test_yaml_lists_booleans_and_nulls_become_arguments(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("report_to: [none, tensorboard]\nfp16: false\nseed: null\nlearning_rate: 0.01\n")
    assert arguments.yaml_to_argv(str(cfg)) == ["--report_to", "none", "tensorboard", "--fp16", "False",
                                                "--learning_rate", "0.01"]
    cfg.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        arguments.yaml_to_argv(str(cfg))


def test_config_file_then_command_line_and_the_given_options(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dataset_name: from_yaml\ntarget_epsilon: 2\n")
    script, train = arguments.parse_args((arguments.ScriptArguments, DPTrainingArguments),
                                         ["--config", str(cfg), "--output_dir", "o", "--target_epsilon", "3"])
    assert script.dataset_name == "from_yaml" and train.target_epsilon == 3 and script.config == str(cfg)
    assert arguments.given_options(["--config", str(cfg), "--seed=1"]) == {"dataset_name", "target_epsilon", "seed"}


def test_dataset_helpers_name_the_flag_to_set():
    import datasets

    raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({"x": [1, 2, 3, 4]}))
    with pytest.raises(ValueError, match=r"no split 'test' \(it has \['train'\]\); set --train_split / --eval_split"):
        utils.pick_splits(raw, "d", "train", "test")
    assert utils.first_column(["img", "label"], ("image", "img"), "--image_column") == "img"
    with pytest.raises(ValueError, match="--text_column"):
        utils.first_column(["a"], ("text",), "--text_column")
    public, private = utils.split_public_private(raw["train"], 0.5, seed=0)
    assert len(public) == 2 and sorted(list(public["x"]) + list(private["x"])) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="public_fraction"):
        utils.split_public_private(raw["train"], 1.0, seed=0)


def test_thin_recipe_files_and_the_cli_run_the_same_main():
    for name, module in [("dp_image_classification", "image_classification"), ("dp_causal_lm", "causal_lm"),
                         ("dp_text_classification", "text_classification"), ("demo", "demo")]:
        text = (ROOT / "recipes" / f"{name}.py").read_text()
        assert f"from hf_dp_repr.scripts.{module} import main" in text and len(text.splitlines()) < 20, name
    from hf_dp_repr.cli import TRAIN_SCRIPTS, build_parser

    args = build_parser().parse_args(["train", "lm", "--config", "x.yaml", "--help"])
    assert TRAIN_SCRIPTS[args.task] == "causal_lm" and args.recipe_args == ["--config", "x.yaml", "--help"]


def test_no_sys_path_manipulation_anywhere():
    offenders = [str(p.relative_to(ROOT)) for folder in ("hf_dp_repr", "recipes", "tests", "benchmarks")
                 for p in (ROOT / folder).rglob("*.py")
                 if "sys.path." + "insert" in p.read_text() or "sys.path." + "append" in p.read_text()]
    assert offenders == []


def test_recipe_file_runs_with_plain_python_help():
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "dp_causal_lm.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--block_size" in out.stdout and "--public_fraction" in out.stdout and "--target_epsilon" in out.stdout
