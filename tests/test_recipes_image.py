"""The image recipe (hf_dp_repr.scripts.image_classification): the offline public → private run, its metrics, card and
push, an npz of RGB images, bf16, and bad arguments refused before public pre-training."""

import json
from pathlib import Path

import numpy as np
import pytest

from hf_dp_repr.hub.card import format_epsilon
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.scripts import utils as ru

ROOT = Path(__file__).resolve().parents[1]


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


def test_bf16_recipe_survives_public_pretraining(tmp_path):
    """The public pre-training used to run in fp32 and set accelerate's process-wide state, so the DP run's mixed
    precision (--fp16 then, refused under DP now; --bf16) failed after it; it now runs in the DP run's precision."""
    metrics = image_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "8", "--target_delta", "1e-4",
                                 "--bf16", "true", "--use_cpu", "true", "--public_fraction", "0.3",
                                 "--public_epochs", "1", "--max_steps", "1", "--per_device_train_batch_size", "64",
                                 "--max_eval_samples", "64",
                                 "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"])
    assert 0 < metrics["epsilon"] <= 8


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
    data, _, label_col, _ = image_recipe.load_image_data(
        image_recipe.ImageArguments(dataset_name=str(tmp_path / "a.npz")), seed=0)
    assert data["train"].features[label_col].names == ["r", "g", "b"]
    assert not (tmp_path / "o").exists()


def test_train_augmentation_transforms_the_private_training_set_only(tmp_path, monkeypatch):
    """--train_augmentation random_shift: the DP training set reads a fresh shift at every read (what
    augmentation_multiplicity averages), reproducible from the views' public seeding; evaluation and public rows
    (the public ones: probe_preconditioning's statistics) are untouched."""
    import torch

    from hf_dp_repr.privacy.augmentation import ViewsDataset

    given = {}

    class Built(Exception):
        pass

    def trainer(**kwargs):  # stands in for DPTrainer: what the recipe would train on
        given.update(kwargs)
        raise Built

    def untrained_public_model(model, public, save_dir, **kwargs):  # the public training is not what is tested
        model.save_pretrained(save_dir)
        return save_dir

    monkeypatch.setattr(image_recipe, "DPTrainer", trainer)
    monkeypatch.setattr(ru, "pretrain_on_public", untrained_public_model)
    with pytest.raises(Built):
        image_recipe.main(["--output_dir", str(tmp_path / "o"), "--public_model_dir", str(tmp_path / "public"),
                           "--noise_multiplier", "1", "--target_delta", "1e-4", "--max_steps", "2",
                           "--public_fraction", "0.1", "--public_epochs", "1", "--trainable_blocks", "0",
                           "--train_augmentation", "random_shift", "--augmentation_multiplicity", "4",
                           "--probe_preconditioning", "standardize",
                           "--report_to", "none", "--disable_tqdm", "true"])
    train, evals, public = given["train_dataset"], given["eval_dataset"], given["public_train_dataset"]
    raw = train.with_format("torch")[:16]["pixel_values"]
    first, second = (torch.stack([train[i]["pixel_values"] for i in range(16)]) for _ in range(2))
    assert first.shape == raw.shape == (16, 1, 8, 8) and not torch.equal(first, second)  # a new draw per read
    assert not torch.equal(first, raw) and torch.equal(train[0]["labels"], train.with_format("torch")[0]["labels"])
    views = ViewsDataset(train, seed=0)
    assert torch.equal(views[(3, (0, 1, 3, 2))]["pixel_values"], views[(3, (0, 1, 3, 2))]["pixel_values"])
    assert evals.format["type"] == public.format["type"] == "torch"  # no transform: the rows as they are
    assert torch.equal(evals[0]["pixel_values"], evals[0]["pixel_values"])
