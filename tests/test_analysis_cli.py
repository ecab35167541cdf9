"""`hf-dp-repr analyze` on saved tiny models (offline), and the figures."""

import argparse
import json
import sys

import numpy as np
import pytest

from hf_dp_repr.analysis import RepresentationReport, fit_law, plot_laws, plot_umap
from hf_dp_repr.analysis.analyze_cli import add_analyze_parser, run_analyze
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(argv):
    parser = argparse.ArgumentParser(prog="hf-dp-repr")
    add_analyze_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_two_vision_models_on_digits(tmp_path):
    tiny_vit(seed=0).save_pretrained(tmp_path / "vit-a")
    tiny_vit(seed=1).save_pretrained(tmp_path / "vit-b")
    out = tmp_path / "law"
    args = parse(["analyze", "--model", str(tmp_path / "vit-a"), "--model", str(tmp_path / "vit-b"),
                  "--dataset", "digits", "--split", "test", "--max-examples", "150", "--knn", "--out", str(out)])
    assert args.func is run_analyze
    assert args.func(args) == 0

    saved = json.loads((out / "representation_law.json").read_text())
    assert saved["dataset"] == "digits" and saved["split"] == "test"
    assert set(saved["models"]) == {"vit-a", "vit-b"}
    a, b = saved["models"]["vit-a"], saved["models"]["vit-b"]
    assert a["model"] == str(tmp_path / "vit-a")
    assert a["num_examples"] == 150 and len(a["fuzziness"]) == 5 and len(a["residual"]) == 5
    assert a["fuzziness"] != b["fuzziness"]  # two different models, not one analysed twice
    assert 0.0 <= a["knn_accuracy"] <= 1.0
    assert a["fuzziness_law"]["layers"] == [0, 1, 2, 3, 4]
    png = (out / "representation_law.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_language_model_on_the_stdlib_corpus_with_byte_fallback(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path / "gpt2")  # no tokenizer saved: byte-level fallback
    out = tmp_path / "law"
    args = parse(["analyze", "--model", str(tmp_path / "gpt2"), "--label", "tiny-gpt2", "--dataset",
                  "stdlib-blocks", "--max-examples", "16", "--block-size", "32", "--out", str(out)])
    assert run_analyze(args) == 0
    report = json.loads((out / "representation_law.json").read_text())["models"]["tiny-gpt2"]
    assert report["task"] == "causal-lm" and report["fuzziness"] is None
    assert report["num_positions"] == 16 * 31 and len(report["residual"]) == 3
    assert (out / "representation_law.png").read_bytes().startswith(PNG_MAGIC)


def test_dataset_saved_to_disk_with_label_column(tmp_path):
    from datasets import Dataset, DatasetDict

    from hf_dp_repr.data import load_digits_dataset

    test = load_digits_dataset()["test"].select(range(120))
    raw = Dataset.from_dict({"pixel_values": test["pixel_values"][:].numpy(), "label": test["labels"][:].numpy()})
    DatasetDict(test=raw).save_to_disk(tmp_path / "data")
    tiny_vit().save_pretrained(tmp_path / "vit")
    args = parse(["analyze", "--model", str(tmp_path / "vit"), "--dataset", str(tmp_path / "data"),
                  "--out", str(tmp_path / "law")])
    assert run_analyze(args) == 0
    assert json.loads((tmp_path / "law" / "representation_law.json").read_text())["models"]["vit"][
        "num_examples"] == 120


def test_cli_errors_say_what_to_do(tmp_path):
    tiny_vit().save_pretrained(tmp_path / "vit")
    with pytest.raises(SystemExit, match="one per model"):
        run_analyze(parse(["analyze", "--model", str(tmp_path / "vit"), "--label", "a", "--label", "b",
                           "--dataset", "digits", "--out", str(tmp_path / "o")]))
    with pytest.raises(SystemExit, match="choose --split from"):
        run_analyze(parse(["analyze", "--model", str(tmp_path / "vit"), "--dataset", "digits",
                           "--split", "validation", "--out", str(tmp_path / "o")]))


def report(values):
    return RepresentationReport("image-classification", "cls", 100, 100, residual=[0.9, 0.5, 0.3, 0.2],
                                fuzziness=values, fuzziness_law=fit_law(values))


def test_plot_laws_one_line_per_curve(tmp_path):
    path = plot_laws({"pretrained": report([9.0, 3.0, 1.0, 0.4]), "ε = 1": report([9.0, 5.0, 3.0, 2.0])},
                     tmp_path / "sub" / "law.png")
    assert path.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="`curves` is empty"):
        plot_laws({}, tmp_path / "x.png")


def test_report_round_trips_through_json():
    original = report([9.0, 3.0, 1.0, 0.4])
    original.fuzziness[2] = float("nan")  # undefined layers are stored as JSON null
    restored = RepresentationReport.from_dict(json.loads(json.dumps(original.to_dict())))
    assert restored.fuzziness[:2] == [9.0, 3.0] and np.isnan(restored.fuzziness[2])
    assert restored.fuzziness_law == original.fuzziness_law


def test_umap_missing_dependency_is_explained(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "umap", None)  # makes `import umap` raise ImportError
    with pytest.raises(ImportError, match="pip install 'hf-dp-repr\\[umap\\]'"):
        plot_umap(np.ones((10, 3)), np.zeros(10), tmp_path / "u.png")


def test_stdlib_paragraphs_without_a_tokenizer_points_to_the_token_blocks(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path / "gpt2")  # no tokenizer saved
    with pytest.raises(SystemExit, match="no tokenizer for the paragraphs of stdlib-docs; --dataset stdlib-blocks"):
        run_analyze(parse(["analyze", "--model", str(tmp_path / "gpt2"), "--dataset", "stdlib-docs",
                           "--out", str(tmp_path / "law")]))


def test_a_vit_is_analysed_at_the_image_size_given(tmp_path):
    """`analyze --image-size 48` on a 32-px ViT: its position embeddings interpolated in the analyzer's forward
    (`analysis.inputs.load_model` installs `data.images.interpolate_positions`). Before: ViT's ValueError 'Input image
    size (48*48) doesn't match model (32*32)'."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.integers(0, 255, (4, 32, 32, 3), dtype=np.uint8), y_train=np.arange(4) % 2,
             x_test=rng.integers(0, 255, (24, 32, 32, 3), dtype=np.uint8), y_test=np.arange(24) % 2,
             class_names=np.array(["a", "b"]))
    tiny_vit(num_labels=2, image_size=32, patch_size=8, num_channels=3).save_pretrained(tmp_path / "vit")
    args = parse(["analyze", "--model", str(tmp_path / "vit"), "--dataset", str(tmp_path / "d.npz"), "--image-size",
                  "48", "--out", str(tmp_path / "law")])
    assert run_analyze(args) == 0
    assert json.loads((tmp_path / "law" / "representation_law.json").read_text())["models"]["vit"][
        "num_examples"] == 24
