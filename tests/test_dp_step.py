"""One logical DP-SGD step of DPTrainer against a brute-force loop, and the noise it adds."""

import copy

import pytest
import torch

from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import ACCUMULATION, BATCH, brute_force_update, relative_error, run_one_step  # noqa: F401  (also imported from here)

MODELS = {
    "vit": lambda: tiny_vit(num_labels=10),
    "gpt2": lambda: tiny_gpt2(),
}
# Clipping norms in the middle of each model's per-example gradient norms (checked by the guard test below),
# so that the step mixes clipped and unclipped examples.
CLIP = {"vit": 21.0, "gpt2": 5.3}


def dataset_for(name, digits, token_dataset):
    return digits["train"].select(range(24)) if name == "vit" else token_dataset


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_step_equals_brute_force(name, clipping, digits, token_dataset, tmp_path):
    dataset = dataset_for(name, digits, token_dataset)
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    clip = CLIP[name]
    grads, batch = run_one_step(model, dataset, tmp_path, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                clipping=clipping)
    assert len(batch) > 0
    want = brute_force_update(reference, dataset, batch, clip, clipping)
    assert set(grads) == set(want)
    assert relative_error(grads, want) <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_clipping_is_active_in_brute_force_setting(name, digits, token_dataset):
    """Guard for the test above: at CLIP[name] some example gradients are clipped and some are not."""
    model, dataset = MODELS[name](), dataset_for(name, digits, token_dataset)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(dataset)):
        example = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
        grads = torch.autograd.grad(model(**example).loss, params)
        norms.append(torch.sqrt(sum((g ** 2).sum() for g in grads)).item())
    assert sum(n > CLIP[name] for n in norms) >= 3 and sum(n < CLIP[name] for n in norms) >= 3


def test_noise_has_std_sigma_c_over_batch(digits, tmp_path):
    dataset = digits["train"].select(range(24))
    sigma, clip = 2.0, CLIP["vit"]
    clean, batch_a = run_one_step(tiny_vit(), dataset, tmp_path / "a", noise_multiplier=0.0,
                                  per_sample_max_grad_norm=clip)
    noisy, batch_b = run_one_step(tiny_vit(), dataset, tmp_path / "b", noise_multiplier=sigma,
                                  per_sample_max_grad_norm=clip)
    assert batch_a == batch_b  # same seed, same Poisson batch: the difference is the noise alone
    noise = torch.cat([(noisy[n] - clean[n]).flatten() for n in clean]).double()
    expected = sigma * clip / (BATCH * ACCUMULATION)
    # ~136k i.i.d. Gaussian coordinates: the sample std has relative standard error 1/sqrt(2·136k) ≈ 0.2 %,
    # so 2 % is a ~10-sigma band; the mean's standard error is expected/sqrt(136k) ≈ 0.3 % of expected.
    assert noise.numel() > 100_000
    assert abs(noise.std().item() / expected - 1) < 0.02
    assert abs(noise.mean().item()) < 0.02 * expected
