"""One logical DP-SGD step of DPTrainer against a brute-force loop, and the noise it adds."""

import copy

import pytest
import torch
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit

BATCH, ACCUMULATION = 4, 3  # logical batch L = 12 of n = 24 examples: q = 0.5


class CaptureUpdate(TrainerCallback):
    """Keeps the private gradient the optimizer applied at the first step (p.grad right after the DP step)."""

    def __init__(self):
        self.grads = None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_one_step(model, dataset, tmp_path, **dp_kwargs):
    capture = CaptureUpdate()
    args = DPTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=3, noise_seed=3, **dp_kwargs,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, callbacks=[capture])
    trainer.train()
    sampler = trainer._batch_sampler
    sampler.set_epoch(0)
    batch = [i for chunk in list(sampler)[:ACCUMULATION] for i in chunk]
    return capture.grads, batch


def brute_force_update(model, dataset, batch, clip, clipping):
    """Σ_i clip(∇ loss_i) / L with each example's gradient computed alone through the model's own HF loss."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in batch:
        example = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
        grads = torch.autograd.grad(model(**example).loss, params)
        if clipping == "flat":
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
            grads = [g * min(1.0, clip / norm.item()) for g in grads]
        else:  # per_layer: each tensor to C / sqrt(#tensors)
            c = clip / len(grads) ** 0.5
            grads = [g * min(1.0, c / g.norm().item()) for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return {n: t / (BATCH * ACCUMULATION) for n, t in zip(names, total)}


def relative_error(got: dict, want: dict) -> float:
    num = sum(((got[n] - want[n]).double() ** 2).sum() for n in want)
    den = sum((want[n].double() ** 2).sum() for n in want)
    return (num / den).sqrt().item()


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
