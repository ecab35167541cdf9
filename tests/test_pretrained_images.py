"""Pretrained image models as they come (issue 40.4): the documented seed-000 reproduction on the real DINOv2-S, a
model that interpolates its position embeddings taking the size the user gives, and a 1-channel model with the
default 3-channel mean."""

import os
from pathlib import Path

import pytest
import torch

from hf_dp_repr.data.images import image_processor_for, interpolate_positions, takes_any_image_size
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
    """DINOv2 interpolates its position embeddings in every forward, a ViT when its forward is passed
    `interpolate_pos_encoding` (read from the signature): 224-px images pass the start-of-training check of a DINOv2
    whose config says 518, 64-px ones that of a 32-px ViT (and the models run on them); a model with fixed-size
    attention biases and no such flag (LeViT) is still refused."""
    from transformers import (
        Dinov2Config,
        Dinov2ForImageClassification,
        LevitConfig,
        LevitForImageClassification,
        ViTConfig,
        ViTForImageClassification,
    )

    dinov2 = Dinov2ForImageClassification(Dinov2Config(image_size=518, patch_size=14, hidden_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, num_labels=3))
    assert takes_any_image_size(dinov2)
    batch = {"pixel_values": torch.randn(2, 3, 224, 224)}
    check_image_size(dinov2, batch)  # no error
    assert dinov2(**batch).logits.shape == (2, 3)
    with pytest.raises(DPConfigError, match="channels"):
        check_image_size(dinov2, {"pixel_values": torch.randn(2, 1, 224, 224)})
    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=64))
    assert takes_any_image_size(vit)
    check_image_size(vit, {"pixel_values": torch.randn(2, 3, 64, 64)})  # no error
    interpolate_positions(vit)
    assert vit(pixel_values=torch.randn(2, 3, 64, 64)).logits.shape == (2, 2)
    levit = LevitForImageClassification(LevitConfig(image_size=32, patch_size=16, hidden_sizes=[16, 32, 48],
                                                    num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
                                                    key_dim=[8, 8, 8], num_labels=2))
    assert not takes_any_image_size(levit)
    with pytest.raises(DPConfigError, match="takes"):
        check_image_size(levit, {"pixel_values": torch.randn(2, 3, 48, 48)})


def test_a_vit_trains_under_dp_at_another_size_than_its_config():
    """Exact per-example gradients of every parameter (the interpolated position embeddings included) of an 8-px
    ViT run on 12-px images, through the Opacus rule (`privacy.modules.embedding`), against one example at a time.
    Before: 'interpolate_pos_encoding is not supported under DP' (and without the flag, ViT's ValueError)."""
    from opacus import GradSampleModule

    from hf_dp_repr.privacy.grad_samplers import register_grad_samplers
    from hf_dp_repr.privacy.loss import per_example_loss
    from hf_dp_repr.tiny import tiny_vit

    register_grad_samplers()
    model = tiny_vit(num_labels=3, image_size=8).double()
    interpolate_positions(model)
    x, y = torch.randn(4, 1, 12, 10, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    params = list(model.parameters())
    one_by_one = [torch.autograd.grad(per_example_loss(model(pixel_values=x[i:i + 1]).logits, y[i:i + 1],
                                                       shift_labels=False).sum(), params) for i in range(4)]
    wrapped = GradSampleModule(model, loss_reduction="sum")
    per_example_loss(wrapped(pixel_values=x).logits, y, shift_labels=False).sum().backward()
    for j, p in enumerate(params):
        torch.testing.assert_close(p.grad_sample, torch.stack([g[j] for g in one_by_one]), rtol=1e-7, atol=1e-12)
    wrapped._close()


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


def test_a_vit_takes_the_image_size_given(tmp_path):
    """A 32-px ViT (a local folder, as a pretrained model comes) with --image_size 48: the recipe resizes to 48 px, and
    the model trains every parameter under DP (its position embeddings interpolated) and evaluates. Before, it was
    refused: '--image_size 48: ... takes 32-px images'."""
    import json

    import numpy as np
    from transformers import ViTForImageClassification

    from hf_dp_repr.scripts import image_classification as image_recipe
    from hf_dp_repr.tiny import tiny_vit

    tiny_vit(num_labels=2, image_size=32, patch_size=8, num_channels=3).save_pretrained(tmp_path / "vit")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.integers(0, 255, (8, 32, 32, 3), dtype=np.uint8), y_train=np.arange(8) % 2,
             x_test=rng.integers(0, 255, (4, 32, 32, 3), dtype=np.uint8), y_test=np.arange(4) % 2,
             class_names=np.array(["a", "b"]))
    argv = ["--model_name_or_path", str(tmp_path / "vit"), "--dataset_name", str(tmp_path / "d.npz"), "--image_size",
            "48", "--max_steps", "2", "--target_epsilon", "8", "--target_delta", "1e-3", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true"]
    probe = image_recipe.main(argv + ["--output_dir", str(tmp_path / "probe")])  # the DP-aware defaults: a probe
    assert 0 <= probe["eval_accuracy"] <= 1 and 0 < probe["epsilon"] <= 8
    metrics = image_recipe.main(argv + ["--dp_defaults", "off", "--per_device_train_batch_size", "4", "--output_dir",
                                        str(tmp_path / "o")])  # every parameter trains
    assert 0 <= metrics["eval_accuracy"] <= 1 and 0 < metrics["epsilon"] <= 8
    assert json.loads((tmp_path / "o" / "privacy_ledger.json").read_text())["steps_done"] == 2
    before, after = (ViTForImageClassification.from_pretrained(tmp_path / d) for d in ("vit", "o"))
    moved = (after.vit.embeddings.position_embeddings - before.vit.embeddings.position_embeddings).abs().max()
    assert moved > 0  # the interpolated position embeddings trained (their DP gradient: privacy.modules.embedding)
