"""The recipes' shared code in the package (hf_dp_repr.scripts): one base of script arguments, the --config parser,
--help listing every DP option, the shipped configs, logging and result tables, the thin recipes/*.py files and
`hf-dp-repr train`; the demo (its summary and the end-to-end run) and the seed 000 / 004 scripts."""

import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainingArguments

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.scripts import arguments, causal_lm, demo, image_classification, text_classification, utils
from hf_dp_repr.scripts import causal_lm as lm_recipe
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.scripts import text_classification as text_recipe
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import given_options, parse_args

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
    assert args.resolved_public_fraction(tiny=True, embedded=True) == 0.5  # the offline demo
    assert args.resolved_public_fraction(tiny=False, embedded=False) == 0.0
    given = arguments.PublicPretrainingArguments(public_fraction=0.2)
    assert given.resolved_public_fraction(tiny=True, embedded=False) == 0.2
    with pytest.raises(arguments.RecipeArgumentError, match="--public_fraction"):  # the user's own data: never taken
        args.resolved_public_fraction(tiny=True, embedded=False, model="tiny_vit")


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

    from hf_dp_repr.data.user_data import check_column

    raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({"x": [1, 2, 3, 4]}))
    with pytest.raises(ValueError, match=r"no split 'valid' \(it has \['train'\]\); set --train_split"):
        utils.pick_splits(raw, arguments.ScriptArguments(train_split="valid"), seed=0)
    assert check_column(["img", "label"], None, ("image", "img"), "--image_column") == "img"
    with pytest.raises(ValueError, match="--text_column"):
        check_column(["a"], None, ("text",), "--text_column")
    public, private = utils.split_public_private(raw["train"], 0.5, seed=0)
    assert len(public) == 2 and sorted(list(public["x"]) + list(private["x"])) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="public_fraction"):
        utils.split_public_private(raw["train"], 1.0, seed=0)


def test_thin_recipe_files_and_the_cli_run_the_same_main():
    for name, module in [("dp_image_classification", "image_classification"), ("dp_causal_lm", "causal_lm"),
                         ("dp_text_classification", "text_classification"), ("demo", "demo")]:
        text = (ROOT / "recipes" / f"{name}.py").read_text()
        assert f'run_recipe("{module}")' in text and len(text.splitlines()) < 20, name  # the one runner
    from hf_dp_repr.cli import TRAIN_SCRIPTS, build_parser

    args = build_parser("train").parse_args(["train", "lm", "--config", "x.yaml", "--help"])
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


# ---- the recipes' options: --help, --config, the shipped configs ----------------------------------------------------
DP_FIELDS = [f for f in dataclasses.fields(DPTrainingArguments)
             if f.name not in {g.name for g in dataclasses.fields(TrainingArguments)}]


RECIPES = [image_recipe, lm_recipe, text_recipe]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda m: m.__name__)
def test_help_lists_every_dp_option_with_its_help(recipe, capsys):
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert len(DP_FIELDS) >= 8
    for field in DP_FIELDS:
        help_text = field.metadata.get("help")
        assert help_text, f"DPTrainingArguments.{field.name} has no help text"
        assert f"--{field.name}" in text, field.name
        first_words = " ".join(help_text.split()[:4]).replace("%", "%%").replace("%%", "%")
        assert first_words in text, (field.name, first_words)
    own = {f.name: f.metadata.get("help") for f in dataclasses.fields(recipe.ARGUMENT_TYPES[0])}
    assert {"model_name_or_path", "dataset_name", "config"} <= set(own)
    for name, help_text in own.items():
        assert help_text and f"--{name}" in text, name


def test_config_file_is_expanded_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target_epsilon: 2\ntarget_delta: 1.0e-5\nreport_to: [none]\npublic_fraction: 0.25\n"
                   "analyze_representations: true\noutput_dir: from_yaml\n")
    margs, targs = parse_args((image_recipe.ImageArguments, DPTrainingArguments),
                                 ["--config", str(cfg), "--target_epsilon", "8"])
    assert targs.target_epsilon == 8 and targs.target_delta == 1e-5 and targs.output_dir == "from_yaml"
    assert margs.public_fraction == 0.25 and margs.analyze_representations is True and margs.config == str(cfg)
    cfg.write_text("no_such_option: 1\ntarget_epsilon: 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        parse_args((image_recipe.ImageArguments, DPTrainingArguments), ["--config", str(cfg)])


def test_every_shipped_config_parses():
    import re

    import yaml

    for cfg in sorted((ROOT / "recipes" / "configs").glob("*.yaml")):
        # its recipe: the command (recipe file or `hf-dp-repr train X`) that reads it, else the recipe named last;
        # none: the demo's image recipe
        named = re.findall(r"(?:recipes/(dp_\w+)\.py|hf-dp-repr (?:train )?(\w+)) --config recipes/configs/"
                           + re.escape(cfg.name), cfg.read_text())
        by_file = {"dp_image_classification": image_recipe, "dp_causal_lm": lm_recipe,
                   "dp_text_classification": text_recipe, "dp_sft": "sft", "dp_dpo": "dpo",
                   "dp_synthetic_text": "synth", "image": image_recipe, "lm": lm_recipe, "text": text_recipe,
                   "sft": "sft", "dpo": "dpo", "synth": "synth"}
        named = [f or c for f, c in named] or re.findall(r"recipes/(dp_\w+)\.py", cfg.read_text())[-1:]
        recipe = by_file[named[0]] if named else image_recipe
        if isinstance(recipe, str):  # (the TRL recipes import trl: only when their config is read)
            recipe = importlib.import_module(f"hf_dp_repr.scripts.{recipe}")
        values = yaml.safe_load(cfg.read_text())
        budget = [] if {"target_epsilon", "noise_multiplier"} & set(values) else ["--target_epsilon", "1"]  # demo
        parse_args(recipe.ARGUMENT_TYPES, ["--config", str(cfg), "--output_dir", "x", *budget])


def test_accuracy_metrics_is_the_fraction_of_argmax_equal_to_label():
    import numpy as np
    from transformers import EvalPrediction

    from hf_dp_repr import accuracy_metrics

    logits = np.eye(3)[[0, 1, 2, 2]]  # argmax 0, 1, 2, 2
    assert accuracy_metrics()(EvalPrediction(logits, np.array([0, 1, 1, 2]))) == {"accuracy": 0.75}
    assert accuracy_metrics()(EvalPrediction((logits, np.zeros(4)), np.array([0, 1, 2, 2]))) == {"accuracy": 1.0}


def test_hub_token_argument_is_refused(tmp_path):
    with pytest.raises(ValueError, match="HF_TOKEN"):
        image_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "1", "--hub_token", "hf_x",
                           "--max_steps", "1"])


# ---- label sets are declared, not read off the private labels -------------------------------------------------------
def test_class_names_come_from_the_declaration_and_labels_must_fit_it():
    import datasets

    from hf_dp_repr.scripts import checks

    plain = datasets.Dataset.from_dict({"label": [0, 1, 1]})
    with pytest.raises(ValueError, match="not a ClassLabel.*--num_labels"):
        checks.class_names(plain, "label")
    assert checks.class_names(plain, "label", num_labels=5) == (5, {i: str(i) for i in range(5)})  # not max + 1
    assert checks.class_names(plain, "label", model_id2label={"0": "neg", "1": "pos"}) == (2, {0: "neg", 1: "pos"})
    with pytest.raises(ValueError, match=r"label\(s\) \[7\].*outside the declared 2 classes"):
        checks.class_names(plain, "label", num_labels=2, others=[datasets.Dataset.from_dict({"label": [7]})])
    named = plain.cast_column("label", datasets.ClassLabel(names=["a", "b", "c"]))
    assert checks.class_names(named, "label") == (3, {0: "a", 1: "b", 2: "c"})
    with pytest.raises(ValueError, match="declares 3 classes"):
        checks.class_names(named, "label", num_labels=4)


# ---- what a run shows ----------------------------------------------------------------------------------------------
def test_recipes_log_epsilon_about_twenty_times_unless_told(tmp_path):
    from hf_dp_repr.scripts import recipe_report

    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1, report_to="none")
    recipe_report.default_logging(args, planned_steps=264, given=set())
    assert args.logging_steps == 13
    args.logging_steps = 7
    recipe_report.default_logging(args, planned_steps=264, given={"logging_steps"})
    assert args.logging_steps == 7
    cfg = tmp_path / "c.yaml"
    cfg.write_text("logging_strategy: epoch\n")
    assert given_options(["--config", str(cfg), "--seed=3"]) == {"logging_strategy", "seed"}


def test_only_the_main_process_logs():
    """With several processes every line used to appear once per process: the others now log errors only."""
    import logging
    from types import SimpleNamespace

    from transformers.utils import logging as hf_logging

    root, ours = logging.getLogger(), logging.getLogger("hf_dp_repr")
    saved = (root.level, ours.level, hf_logging.get_verbosity())
    replica = SimpleNamespace(should_log=False, log_level_replica="warning")
    try:
        ru.setup_logging(replica)
        assert replica.log_level_replica == "error"
        trainer_logger = hf_logging.get_logger("hf_dp_repr.trainer")
        assert not trainer_logger.isEnabledFor(logging.WARNING)  # the plan table is a warning
        assert not logging.getLogger("hf_dp_repr.recipes").isEnabledFor(logging.WARNING)
        assert hf_logging.get_verbosity() == logging.ERROR
        ru.setup_logging(SimpleNamespace(should_log=True, log_level_replica="warning"))
        assert trainer_logger.isEnabledFor(logging.WARNING) and logging.getLogger("hf_dp_repr.recipes").isEnabledFor(
            logging.INFO)
    finally:
        logging.captureWarnings(False)
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
        hf_logging.set_verbosity(saved[2])


def test_result_table_states_metrics_and_privacy():
    from hf_dp_repr.privacy.ledger import Phase, PrivacyLedger, PrivacyPlan
    from hf_dp_repr.scripts import recipe_report

    ledger = PrivacyLedger(PrivacyPlan(accountant="prv", target_delta=1e-5, per_sample_max_grad_norm=1.0,
                                       clipping="flat", dataset_size=1006, poisson_sampling=True,
                                       phases=[Phase("train", 1.5, 0.1, 30, 100)], target_epsilon=8.0, world_size=1))
    table = recipe_report.result_table({"eval_accuracy": 0.8642, "epsilon": 7.99}, ledger, "test",
                                       {"sample (greedy, DP model)": "'a | b'"})
    assert "| test accuracy" in table and "86.4 %" in table and "7.9900 (target 8)" in table
    assert "| δ" in table and "1e-05" in table and "0 of 30 (σ = 1.500, q = 0.1000" in table
    assert "'a / b'" in table  # a sample cannot break the table
    assert "NOT private" in recipe_report.result_table({"epsilon": float("inf")}, ledger, "test")


@pytest.mark.slow
def test_demo_shortened_shows_what_dp_fine_tuning_does_to_the_layers(tmp_path, capsys):
    """`make demo`'s script, shortened (3 epochs, three rows): the rows that train blocks under DP move the hidden
    states (laws and CKA differ from the public model's), the DP linear probe (ε = 1's headline scope) leaves them
    exactly as they were; a line per stage, the table, the figures and the closing lines. The full tables and the
    ≥ 3-point gain of ε = 1: benchmarks/RESULTS.md ("The demo's rows")."""
    from hf_dp_repr.scripts import demo

    assert demo.HEADLINE[1] == "linear probe" and "--trainable_blocks" in demo.RUNS["dp_eps1"]
    # noise_seed: the same batches and noise every run (the demo itself draws a fresh secret)
    summary = demo.main(["--output_dir", str(tmp_path), "--rows", "eps1_lpft", "eps1_ft", "--",
                         "--num_train_epochs", "3", "--noise_seed", "0"])
    runs = summary["runs"]
    assert set(runs) == {"public_only", "dp_eps1", "eps1_lpft", "eps1_ft"}
    assert all(runs[name]["epsilon"] <= 1.0 for name in ("dp_eps1", "eps1_lpft", "eps1_ft"))
    assert runs["dp_eps1"]["scope"] == "linear probe"
    public = runs["public_only"]
    for name in ("eps1_lpft", "eps1_ft"):  # blocks trained under DP: the representations moved
        assert runs[name]["rho_fuzziness"] != public["rho_fuzziness"]
        assert runs[name]["fuzziness"][-1] != public["fuzziness"][-1]
        assert runs[name]["cka"][-1] < 0.9999 and runs[name]["cka"][0] == pytest.approx(1.0)  # the embeddings: frozen
    probe = runs["dp_eps1"]  # the head alone: every hidden state is the public model's
    assert probe["fuzziness"] == pytest.approx(public["fuzziness"], rel=1e-6)
    assert probe["cka"] == pytest.approx([1.0] * len(public["fuzziness"]), abs=1e-6)
    printed = capsys.readouterr().out
    assert "[1/4] dp_eps1 (DP linear probe, ε = 1 (the scope for ε = 1)): public pre-training" in printed
    assert "[4/4] report" in printed and "ε = 1 (linear probe, the scope for ε = 1) is" in printed
    assert "| public_only | public model, no private data | 0 (no private data) |" in printed
    assert "Seeds 001/003" in printed and "Seed 002" in printed
    for figure in ("laws.png", "fuzziness_by_layer.png", "accuracy_vs_epsilon.png"):
        assert (tmp_path / "report" / figure).read_bytes().startswith(b"\x89PNG")
    card = (tmp_path / "report" / "model_card_dp_eps1.md").read_text()
    assert "of classes [0, 1, 2, 3, 4] only" in card  # the card says what the public data was


def test_public_pretraining_prints_progress_lines():
    from types import SimpleNamespace

    from hf_dp_repr.scripts import recipe_report

    lines = []
    cb = recipe_report.ProgressLines("public pre-training", epochs=40, log=lines.append)
    args = SimpleNamespace(num_train_epochs=40)
    for epoch in range(1, 41):
        cb.on_log(args, None, None, logs={"loss": 1.0 / epoch})
        cb.on_epoch_end(args, SimpleNamespace(epoch=float(epoch), is_world_process_zero=True), None)
    assert len(lines) == 8 and lines[0].startswith("public pre-training: epoch 5/40, loss 0.200")
    assert lines[-1].startswith("public pre-training: epoch 40/40")


@pytest.mark.slow
def test_seed004_comparison_recipe_runs_every_arm_at_the_same_epsilon(tmp_path, capsys):
    from hf_dp_repr.scripts import seed004_continual

    results = seed004_continual.main([
        "--output_dir", str(tmp_path), "--target_epsilon", "8", "--target_delta", "1e-5", "--max_steps", "3",
        "--public_max_steps", "4", "--public_check_steps", "2", "--per_device_train_batch_size", "16",
        "--tokenizer_vocab_size", "300", "--max_eval_blocks", "32", "--report_to", "none", "--disable_tqdm", "true",
        "--hessian_probes", "2", "--hessian_max_examples", "8"])
    assert set(results) == {"dp_scratch", "public_only", "fixed", "decelerator"}
    eps = {results[r]["epsilon"] for r in ("dp_scratch", "fixed", "decelerator")}
    assert len(eps) == 1 and 0 < eps.pop() <= 8  # the same plan, only private steps accounted
    assert results["fixed"]["switch_step"] == 4 and 1 <= results["decelerator"]["switch_step"] <= 4
    assert (tmp_path / "tr_h.png").exists() and "| fixed |" in capsys.readouterr().out


# ---- the demo's summary and the seed 000 sweep ----------------------------------------------------------------------
def _refuse(constant):
    raise ValueError(f"not valid JSON: {constant}")


def test_summary_json_has_no_infinity_and_says_which_run_is_not_private():
    from hf_dp_repr.scripts import demo_report

    rows = {name: dict(epsilon=eps, delta=1e-4, noise_multiplier=[sigma], accuracy=acc, rho_fuzziness=0.5,
                       rho_residual=0.9, seconds=1.0, law_entry={}, first_law_entry={}, fuzziness=[3.0, 1.0],
                       cka=[1.0, 0.9])
            for name, eps, sigma, acc in [("public_only", 0.0, None, 0.6), ("dp_eps1", 0.99, 4.0, 0.8),
                                          ("dp_eps8", 7.9, 1.0, 0.85), ("non_private", math.inf, 0.0, 0.9)]}
    text = json.dumps(demo_report.summary_of(rows, gain=2.0, gap=10.0, seconds=3.0), indent=2, default=str,
                      allow_nan=False)
    summary = json.loads(text, parse_constant=_refuse)
    runs = summary["runs"]
    assert runs["non_private"]["epsilon"] is None and runs["non_private"]["differentially_private"] is False
    assert runs["dp_eps1"]["epsilon"] == 0.99 and runs["dp_eps1"]["differentially_private"] is True
    assert runs["public_only"]["differentially_private"] is False  # it saw no private data: no ε to state
    assert "law_entry" not in runs["dp_eps8"] and summary["private_data_helps"] is False
    table = demo_report.table_of(rows, demo.ROW_TITLES)
    assert "| non_private | LP→FT, not private | ∞ |" in table  # the printed table still says ∞
    rows["non_private"].update(epsilon=None, noise_multiplier=[0.0, 0.0])  # as its ledger has it after LP→FT
    assert "| non_private | LP→FT, not private | ∞ |" in demo_report.table_of(rows, demo.ROW_TITLES)
    assert "ρ: the decay per layer" in table and "1.00 0.90 |" in table  # ρ and CKA explained where printed


def test_demo_closing_lines_say_when_a_seed_claim_does_not_hold():
    from hf_dp_repr.scripts import demo_report

    def row(acc, fuzz, cka, rho=0.5):
        return dict(accuracy=acc, fuzziness=[4.0, fuzz], cka=[1.0, cka], rho_fuzziness=rho)

    rows = {"public_only": row(0.45, 2.0, 1.0, rho=0.9), "dp_eps1": {**row(0.49, 2.0, 1.0, rho=0.9),
                                                                     "scope": "linear probe"},
            "non_private": row(0.60, 0.8, 0.9), "eps1_lpft": row(0.50, 1.0, 0.95),
            "eps1_ft": row(0.47, 1.5, 0.80), "eps1_untuned_lr": row(0.52, 0.9, 0.9)}
    lines = demo_report.closing_lines(rows, gain=5.0, gap=10.0)
    text = "\n".join(lines)
    assert "ε = 1 (linear probe, the scope for ε = 1) is +5.0" in lines[0] and "at least +3" in lines[0]
    assert "for 4 of 5 trained rows (non_private, eps1_lpft, eps1_ft, eps1_untuned_lr)" in lines[1]
    assert "Seed 000" in text and text.split("Seed 000")[1].split("\n")[0].endswith("does not hold here (higher D: "
                                                                                 "classes less separated).")
    assert "0.800 without LP against 0.950 with LP→FT" in text
    assert "LP→FT, accuracy 47.0 % against 50.0 %: holds" in text
    assert "linear probe 49.0 %, LP→FT 50.0 %, FT without LP 47.0 %; best in this run: LP→FT" in text
    assert "NOT +3" in demo_report.closing_lines(rows, gain=2.9, gap=10.0)[0]
    rows["eps1_untuned_lr"] = row(0.40, 3.0, 0.7)
    assert "Seed 000" in (line := demo_report.closing_lines(rows, 5.0, 10.0)[2]) and line.endswith(
        "holds here (higher D: classes less separated).")


@pytest.mark.slow
def test_seed000_sweep_writes_its_report(tmp_path):
    from hf_dp_repr.scripts.seed000 import run_seed000

    space = lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-2, log=True),  # noqa: E731
                       "num_train_epochs": t.suggest_categorical("num_train_epochs", [1])}
    summary = run_seed000(str(tmp_path), epsilons=(1.0,), ks=(1, 4), n_trials=1, pretrain_epochs=3,
                          constant_epochs=1, hp_space=space, progress=False)
    assert [(r["k"], r["run"]) for r in summary["rows"]] == [(1, "tuned"), (1, "constant_lr"), (4, "tuned"),
                                                             (4, "constant_lr")]
    for r in summary["rows"]:
        assert r["epsilon_spent"] == pytest.approx(1.0, rel=0.01)
        assert len(r["fuzziness"].split(",")) == 5  # D_l at the embedding output and after each of the 4 blocks
    for name in ("report.md", "results.csv", "summary.json", "accuracy_vs_k.png", "fuzziness_by_layer.png"):
        assert os.path.exists(tmp_path / name)


def test_public_classes_and_shift_make_another_task_and_validation_is_carved_from_the_private_rows(tmp_path):
    """The demo's public task: only the public rows of the given classes pre-train, their images shifted; the
    validation rows come out of the private training rows (never the test split), and the card says both."""
    import torch

    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.data.images import shift_images
    from hf_dp_repr.scripts import image_classification
    from hf_dp_repr.scripts import utils as ru

    image_classification.main([
        "--output_dir", str(tmp_path), "--noise_multiplier", "1", "--public_fraction", "0.3", "--public_classes", "0",
        "1", "--public_shift", "mirror", "--public_epochs", "1", "--validation_fraction", "0.2", "--max_steps", "1",
        "--per_device_train_batch_size", "32", "--trainable_blocks", "0", "--save_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"])
    public, private = ru.split_public_private(load_digits_dataset()["train"], 0.3, 0)
    expected = sum(int(y) in (0, 1) for y in public["labels"])
    marker = json.loads((tmp_path / "public_pretrained" / ru.PUBLIC_PRETRAINING_FILE).read_text())
    assert marker["examples"] == expected < len(public) and marker["signature"]["classes"] == [0, 1]
    card = (tmp_path / "README.md").read_text()
    assert "of classes [0, 1] only" in card and "(mirror)" in card
    held_out = round(0.2 * len(private))
    assert f"{held_out} private training rows held out as validation" in card
    assert f"{len(private) - held_out} examples of the 'train' split" in card
    mirrored = shift_images(public.select(range(2)).with_format("torch"), "mirror")[:]["pixel_values"]
    assert torch.equal(mirrored, public.with_format("torch")[:2]["pixel_values"].flip(-1))


@pytest.mark.slow
def test_causal_lm_compares_public_dp_and_non_private_reference_layer_by_layer(tmp_path, capsys):
    """--compare_representations: PR_l at every layer of the public model, the DP model and the non-private reference
    (another run with noise_multiplier 0), in a subfolder (never pushed); the DP model's row differs from the public
    one (it trained)."""
    from hf_dp_repr.scripts import repr_compare

    short = ["--max_steps", "3", "--public_epochs", "1", "--per_device_train_batch_size", "16",
             "--tokenizer_vocab_size", "300", "--max_eval_blocks", "48", "--report_to", "none", "--disable_tqdm",
             "true", "--target_delta", "1e-5", "--noise_seed", "0"]
    lm_recipe.main(["--output_dir", str(tmp_path / "ref"), "--noise_multiplier", "0", *short])
    lm_recipe.main(["--output_dir", str(tmp_path / "dp"), "--target_epsilon", "8", "--compare_representations", "true",
                    "--reference_model_dir", str(tmp_path / "ref"),
                    "--public_model_dir", str(tmp_path / "ref" / "public_pretrained"), *short])
    folder = tmp_path / "dp" / repr_compare.FOLDER
    saved = json.loads((folder / "comparison.json").read_text())
    public, dp, ref = saved.values()
    assert list(saved)[2] == "non-private reference" and list(saved)[1].startswith("DP (ε = ")
    assert len(public["residual"]) == len(dp["residual"]) == len(ref["residual"]) == 3  # embeddings + 2 blocks
    assert dp["residual"] != public["residual"] and ref["residual"] != public["residual"]
    assert (folder / "layers.png").read_bytes().startswith(b"\x89PNG")
    assert "| non-private reference |" in capsys.readouterr().out and "ρ PR_l" in (folder / "table.md").read_text()


def test_comparison_arguments_are_refused_before_any_work(tmp_path):
    from types import SimpleNamespace

    from hf_dp_repr.errors import RecipeArgumentError
    from hf_dp_repr.scripts import repr_compare

    with pytest.raises(RecipeArgumentError, match="--compare_representations true"):
        repr_compare.check_arguments(SimpleNamespace(reference_model_dir=str(tmp_path), compare_representations=False))
    with pytest.raises(RecipeArgumentError, match="no such folder"):
        repr_compare.check_arguments(SimpleNamespace(reference_model_dir=str(tmp_path / "x"),
                                                     compare_representations=True))
    with pytest.raises(RecipeArgumentError, match="--fsdp"):
        repr_compare.check_arguments(SimpleNamespace(reference_model_dir=None, compare_representations=True),
                                     SimpleNamespace(fsdp="full_shard"))
    assert repr_compare.reference_label(str(tmp_path)) == "reference (no ledger)"
    (tmp_path / "privacy_ledger.json").write_text(json.dumps({"epsilon": None}))
    assert repr_compare.reference_label(str(tmp_path)) == "non-private reference"
