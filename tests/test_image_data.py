"""Image inputs of the image recipe and `hf-dp-repr analyze`: the subset rule and index files, the family defaults
when a model folder has no image processor, and preprocessing once with `map` (so the linear probe caches)."""

import logging

import numpy as np
import pytest
from transformers import Dinov2Config

from hf_dp_repr.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    image_processor_for,
    load_npz,
    per_class_indices,
    read_index_file,
    to_pixel_values,
    write_index_file,
)
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.scope.feature_store import data_reason_not_to_cache
from hf_dp_repr.tiny import tiny_vit


def _npz(tmp_path, n=30, classes=3):
    rng = np.random.default_rng(0)
    path = tmp_path / "imgs.npz"
    np.savez(path, x_train=rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), y_train=np.arange(n) % classes,
             x_test=rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8), y_test=np.arange(6) % classes)
    return path


def test_per_class_rule_is_the_documented_one_and_an_index_file_reproduces_it(tmp_path):
    labels = np.array([2, 0, 1, 0, 2, 1, 0, 1, 2, 0])
    rows = per_class_indices(labels, 2, seed=5)
    rng = np.random.default_rng(5)  # the rule, written out
    want = np.sort(np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:2] for c in (0, 1, 2)]))
    assert rows.tolist() == want.tolist() and np.bincount(labels[rows]).tolist() == [2, 2, 2]
    write_index_file(tmp_path / "rows.txt", rows, "two per class\nseed 5")
    assert (tmp_path / "rows.txt").read_text().startswith("# two per class\n# seed 5\n")
    assert read_index_file(tmp_path / "rows.txt", len(labels)) == rows.tolist()
    (tmp_path / "bad.txt").write_text("1\n1\n")
    with pytest.raises(DPConfigError, match="repeat"):
        read_index_file(tmp_path / "bad.txt", 10)
    (tmp_path / "bad.txt").write_text("3  # ok\n12\n")
    with pytest.raises(DPConfigError, match=r"rows \[12\] are outside"):
        read_index_file(tmp_path / "bad.txt", 10)


def test_dinov2_folder_without_processor_gets_imagenet_statistics_at_224(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        proc, how = image_processor_for(str(tmp_path), Dinov2Config(), pretrained=True)  # folder: no processor
    assert tuple(proc.image_mean) == IMAGENET_MEAN and tuple(proc.image_std) == IMAGENET_STD
    assert proc.size == {"height": 224, "width": 224} and "DINOv2 family's defaults" in how
    assert "mean (0.485, 0.456, 0.406)" in how and not caplog.records  # nothing asks for action here
    proc, how = image_processor_for(str(tmp_path), Dinov2Config(), image_size=112, image_mean=[0.1, 0.2, 0.3])
    assert proc.size["height"] == 112 and list(proc.image_mean) == [0.1, 0.2, 0.3]
    assert tuple(proc.image_std) == IMAGENET_STD and "applied" in how


def test_unknown_family_is_normalised_with_a_warning_that_asks_for_the_values(tmp_path, caplog):
    from transformers import ResNetConfig

    with caplog.at_level(logging.WARNING):
        proc, _ = image_processor_for(str(tmp_path), ResNetConfig(), pretrained=True)
    assert list(proc.image_mean) == [0.5] * 3 and "--image_mean/--image_std" in caplog.text


def test_preprocessing_is_a_map_so_the_probe_may_cache(tmp_path, recwarn, capfd):
    data = load_npz(str(_npz(tmp_path)), num_labels=3)
    proc, _ = image_processor_for("tiny_vit", tiny_vit(num_channels=3).config, pretrained=False, image_size=16)
    out = to_pixel_values(data["train"], "img", proc)
    assert data_reason_not_to_cache(out) is None  # a transform would disable feature caching
    assert out[0]["pixel_values"].shape == (3, 16, 16) and "img" not in out.column_names
    assert not [w for w in recwarn if "torchvision" in str(w.message)]
    assert "torchvision" not in capfd.readouterr().err  # transformers' "falls back to the PIL backend" line
    with pytest.raises(DPConfigError, match="--num_labels"):
        load_npz(str(_npz(tmp_path)))


def test_analyze_reads_the_recipes_npz_with_a_folder_without_image_processor(tmp_path, capsys):
    from hf_dp_repr.cli import main

    model_dir = tmp_path / "model"
    tiny_vit(num_labels=3, num_channels=3, image_size=16).save_pretrained(model_dir)  # no preprocessor_config.json
    assert main(["analyze", "--model", str(model_dir), "--dataset", str(_npz(tmp_path)), "--num-labels", "3",
                 "--image-size", "16", "--split", "test", "--out", str(tmp_path / "law")]) == 0
    assert "| model | image-classification (cls) | 6 |" in capsys.readouterr().out
    with pytest.raises(DPConfigError, match="--num_labels"):  # the .npz declares no classes: same rule as the recipe
        main(["analyze", "--model", str(model_dir), "--dataset", str(_npz(tmp_path)), "--out", str(tmp_path / "x")])
