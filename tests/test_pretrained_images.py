"""Pretrained image models as they come (issue 40.4): the documented seed-000 reproduction on the real DINOv2-S, a
model that interpolates its position embeddings taking the size the user gives, and a 1-channel model with the
default 3-channel mean."""

import os
from pathlib import Path

import pytest
import torch

from hf_dp_repr.data.images import image_processor_for, takes_any_image_size
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.training.data_checks import check_image_size

ROOT = Path(__file__).resolve().parents[1]
# `../shared/data` beside the checkout (CI and the main checkout); HF_DP_REPR_SHARED_DATA names it elsewhere
SHARED_DATA = Path(os.environ.get("HF_DP_REPR_SHARED_DATA", ROOT.parent / "shared" / "data"))
SEED000_CONFIG = "recipes/configs/seed000_dinov2s_cifar10partial_probe_eps1.yaml"


@pytest.mark.skipif(not (SHARED_DATA / "dinov2-small-imgfocus").is_dir(), reason=f"no {SHARED_DATA}")
def test_documented_seed000_reproduction_runs(tmp_path, monkeypatch):
    """docs/seeds.md's command, `recipes/dp_image_classification.py --config <seed000 probe config>`, run from a
    checkout whose `../shared/data` is the real data, shortened: 20 training images, 8 test images, 2 DP steps. It
    was refused before its first step: preprocessed to 224 px, then checked against the config's 518 px."""
    from hf_dp_repr.scripts import image_classification as image_recipe

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "recipes").symlink_to(ROOT / "recipes")  # the config's relative paths, as from the repository root
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(SHARED_DATA.resolve())
    rows = (ROOT / "recipes/configs/cifar10_partial_100_per_class.txt").read_text().split("\n")
    (tmp_path / "few.txt").write_text("\n".join([r for r in rows if r and not r.startswith("#")][::50]))
    monkeypatch.chdir(checkout)
    metrics = image_recipe.main(["--config", SEED000_CONFIG, "--train_indices_file", str(tmp_path / "few.txt"),
                                 "--max_eval_samples", "8", "--per_device_train_batch_size", "10", "--max_steps", "2",
                                 "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true"])
    assert 0 < metrics["epsilon"] <= 1 and 0 <= metrics["eval_accuracy"] <= 1


def test_a_model_that_interpolates_takes_the_size_given():
    """DINOv2 interpolates its position embeddings in every forward: 224-px images pass the start-of-training check
    of a model whose config says 518 (and the model runs on them); a ViT without interpolation is still refused."""
    from transformers import Dinov2Config, Dinov2ForImageClassification, ViTConfig, ViTForImageClassification

    dinov2 = Dinov2ForImageClassification(Dinov2Config(image_size=518, patch_size=14, hidden_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, num_labels=3))
    assert takes_any_image_size(dinov2.config)
    batch = {"pixel_values": torch.randn(2, 3, 224, 224)}
    check_image_size(dinov2, batch)  # no error
    assert dinov2(**batch).logits.shape == (2, 3)
    with pytest.raises(DPConfigError, match="channels"):
        check_image_size(dinov2, {"pixel_values": torch.randn(2, 1, 224, 224)})
    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=64))
    assert not takes_any_image_size(vit.config)
    with pytest.raises(DPConfigError, match="takes"):
        check_image_size(vit, {"pixel_values": torch.randn(2, 3, 64, 64)})


def test_a_one_channel_model_gets_a_one_channel_normalisation():
    """A 1-channel ViT with no image processor: the family's 3-channel mean/std would make transformers raise a
    ValueError at the first image; the processor normalises one channel (their average), and says so. A mean of
    another length given by the user is refused in one typed line naming --image_mean."""
    import numpy as np
    from PIL import Image
    from transformers import ViTConfig

    config = ViTConfig(image_size=8, num_channels=1)
    processor, how = image_processor_for("my/vit", config, pretrained=False)
    assert len(processor.image_mean) == 1 and "1 channel" in how
    out = processor([Image.fromarray(np.zeros((8, 8), np.uint8), mode="L")], return_tensors="np")["pixel_values"]
    assert out.shape == (1, 1, 8, 8)
    with pytest.raises(DPConfigError, match="--image_mean"):
        image_processor_for("my/vit", config, pretrained=False, image_mean=[0.5, 0.5, 0.5], image_std=[0.5] * 3)


def test_another_size_for_a_model_that_does_not_interpolate_is_refused_before_any_work(tmp_path):
    """A ViT (its position embeddings fixed to config.image_size) with --image_size of another size: refused by the
    recipe in one line naming --image_size, before preprocessing, instead of at the first training step."""
    import numpy as np

    from hf_dp_repr.errors import RecipeArgumentError
    from hf_dp_repr.scripts import image_classification as image_recipe
    from hf_dp_repr.tiny import tiny_vit

    tiny_vit(num_labels=2, image_size=16, num_channels=3).save_pretrained(tmp_path / "vit")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.integers(0, 255, (8, 16, 16, 3), dtype=np.uint8), y_train=np.arange(8) % 2,
             x_test=rng.integers(0, 255, (4, 16, 16, 3), dtype=np.uint8), y_test=np.arange(4) % 2,
             class_names=np.array(["a", "b"]))
    with pytest.raises(RecipeArgumentError, match="--image_size 32: .* takes 16-px images"):
        image_recipe.main(["--model_name_or_path", str(tmp_path / "vit"), "--dataset_name", str(tmp_path / "d.npz"),
                           "--image_size", "32", "--target_epsilon", "8", "--target_delta", "1e-3",
                           "--output_dir", str(tmp_path / "o"), "--report_to", "none"])
    assert not (tmp_path / "o").exists()
