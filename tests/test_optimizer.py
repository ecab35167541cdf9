"""The DP optimizer (privacy/optimizer.py): one logical DP-SGD step of DPTrainer against a brute-force loop, the
noise it adds, bf16 contributions clipped in float32, the true non-private reference (`clipping="none"` with
`noise_multiplier=0`: the plain mean gradient, and the ledger, the log and the card say ε = ∞ and "no clipping"), and
a unit that comes back after it was clipped."""

import copy
import json
import logging

import pytest
import torch
from opacus.grad_sample import GradSampleHooks

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer
from hf_dp_repr.privacy.randomness import DPRandomness
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import ACCUMULATION, BATCH, brute_force_update, relative_error, run_one_step

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


# ---- the true non-private reference: clipping='none' ----------------------------------------------------------------
def test_unclipped_update_is_the_plain_gradient_and_is_labelled(digits, tmp_path, caplog):
    data = digits["train"].select(range(24))
    model = tiny_vit(num_labels=10)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING):
        grads, batch = run_one_step(model, data, tmp_path, noise_multiplier=0.0, clipping="none",
                                    per_sample_max_grad_norm=1e-3)  # a C this small would clip every example
    plain = brute_force_update(reference, data, batch, clip=float("inf"), clipping="flat")
    clipped = brute_force_update(copy.deepcopy(reference), data, batch, clip=1e-3, clipping="flat")
    assert relative_error(grads, plain) <= 1e-5 and relative_error(grads, clipped) > 0.5
    assert "NOT differentially private (ε = ∞); no clipping (the plain gradient)" in caplog.text


def test_ledger_and_card_say_no_clipping(digits, tmp_path):

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, clipping="none", max_steps=1,
                               per_device_train_batch_size=64, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=digits["train"])
    trainer.train()
    trainer.save_model()
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["clipping"] == "none" and ledger["epsilon"] is None  # ε = ∞ is stored as null
    card = (tmp_path / "README.md").read_text()
    assert "NOT differentially private (ε = ∞)" in card and "no clipping: the plain gradient" in card


# ---- float32 clipping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("clipping", ["flat", "automatic", "per_layer"])
def test_bf16_contributions_stay_within_the_clipping_norm(digits, clipping):
    torch.manual_seed(0)
    model = tiny_vit(num_labels=10).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = 1e-2  # far below every example's gradient norm: every example is clipped
    opt = MicroBatchDPOptimizer(torch.optim.SGD(params, lr=0.1), clipping=clipping, noise_multiplier=0.0,
                                max_grad_norm=clip, expected_batch_size=1,
                                noise_generator=lambda device: DPRandomness().noise_generator(0, device))
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
    worst = 0.0
    for i in range(16):
        x = digits["train"][i]
        logits = model(pixel_values=x["pixel_values"][None].to(torch.bfloat16)).logits
        torch.nn.functional.cross_entropy(logits.float(), x["labels"][None]).backward()
        opt.accumulate_micro_batch()
        assert all(opt._clipped_sums[p].dtype == torch.float32 for p in params)
        worst = max(worst, torch.sqrt(sum((opt._clipped_sums[p].double() ** 2).sum() for p in params)).item() / clip)
        opt.zero_grad()
    hooks.remove_hooks()
    # Contributions reach C (they are clipped; per layer, small tensors stay under C/√k) and never exceed it.
    assert (0.5 if clipping == "per_layer" else 0.99) < worst <= 1 + 1e-6


# ---- privacy units --------------------------------------------------------------------------------------------------
def test_optimizer_refuses_a_unit_that_comes_back_after_it_was_clipped():
    """A unit clipped in one micro-batch and seen again in a later one would contribute up to 2C: the run stops."""
    from opacus.grad_sample import GradSampleHooks

    from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer

    model = torch.nn.Linear(3, 1)
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
    opt = MicroBatchDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), clipping="flat", noise_multiplier=0.0,
                                max_grad_norm=1.0, expected_batch_size=2, noise_generator=lambda d: None)

    def micro_batch(units):
        model(torch.randn(len(units), 3)).sum().backward()
        opt.accumulate_micro_batch(torch.tensor(units))

    micro_batch([0, 0, 1])  # unit 0 is complete here (clipped); unit 1 stays open
    micro_batch([1, 2])  # unit 1 continues: fine
    with pytest.raises(RuntimeError, match="unit 0 appears again"):
        micro_batch([0])
    hooks.remove_hooks()
