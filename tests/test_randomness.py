"""Where DP-SGD's random draws come from: never the Trainer's public `seed`, never stored, fresh at every step."""

import os

import pytest
import torch
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit


class CaptureUpdates(TrainerCallback):
    """The update (p.grad right after each DP step), flattened."""

    def __init__(self):
        self.updates = []

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.updates.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).clone())


def run(dataset, output_dir, steps=1, **kw):
    capture = CaptureUpdates()
    kw = {"noise_multiplier": 1e6, "save_strategy": "no", **kw}
    args = DPTrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=8, max_steps=steps,
                               learning_rate=1e-9, report_to="none", disable_tqdm=True, **kw)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=dataset, callbacks=[capture])
    trainer.train()
    return trainer, capture.updates


def relative_difference(a, b):
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("secure_mode", [False, True])
def test_same_public_seed_gives_different_noise(digits, tmp_path, secure_mode):
    # Before the fix the noise followed torch's global RNG, which the Trainer seeds from args.seed: two runs with
    # the same seed gave updates equal to 1e-8, so anyone who knew the seed could subtract the noise.
    data = digits["train"].select(range(64))
    _, a = run(data, tmp_path / "a", steps=2, seed=42, secure_mode=secure_mode)
    _, b = run(data, tmp_path / "b", steps=2, seed=42, secure_mode=secure_mode)
    assert relative_difference(a[0], b[0]) > 1.0  # independent N(0, σ²) draws: about √2
    assert relative_difference(a[0], a[1]) > 1.0  # and fresh at every step


def test_noise_and_batches_do_not_depend_on_the_trainer_seed(digits, tmp_path):
    data = digits["train"].select(range(64))
    trainer7, a = run(data, tmp_path / "a", seed=7, noise_seed=5, noise_multiplier=1.0)
    trainer8, b = run(data, tmp_path / "b", seed=8, noise_seed=5, noise_multiplier=1.0)
    assert torch.equal(a[0], b[0])  # only noise_seed reproduces a run's DP draws
    assert trainer7.ledger.plan.randomness == "seeded"
    _, c = run(data, tmp_path / "c", seed=7, noise_seed=6, noise_multiplier=1.0)
    assert relative_difference(a[0], c[0]) > 0.1


def test_seeded_run_is_marked_not_private(digits, tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        trainer, _ = run(digits["train"].select(range(64)), tmp_path, noise_seed=1)
    finally:
        hf_logging.disable_propagation()
    assert trainer.ledger.to_dict()["randomness"] == "seeded"
    assert "NOT private against anyone who knows it" in caplog.text


def test_the_secret_is_stored_nowhere(digits, tmp_path):
    trainer, _ = run(digits["train"].select(range(64)), tmp_path, steps=2, save_strategy="steps", save_steps=1)
    trainer.save_model()
    assert trainer.ledger.plan.randomness == "os-entropy"
    secrets = {str(trainer.engine.randomness._secret), str(trainer.engine.randomness.sampling_seed())}
    secrets |= {s[:12] for s in secrets}
    written = 0
    for folder, _, files in os.walk(tmp_path):
        for name in files:
            data = open(os.path.join(folder, name), "rb").read()
            written += 1
            assert not any(s.encode() in data for s in secrets), name
    assert written >= 5


@pytest.mark.parametrize("noise_seed", [None, 7])
def test_each_shard_noise_stream_is_its_own(noise_seed):
    """Sharded runs: each rank noises its rows from a stream of its own, none of which replays the unsharded step's
    stream or another step's (keying shard 0 as (noise, step, 0) would replay it for a small secret, e.g. a
    noise_seed: numpy's SeedSequence gives [s, 1, 3, 0] and [s, 1, 3] the same state)."""
    from hf_dp_repr.privacy.randomness import DPRandomness

    randomness = DPRandomness(noise_seed)

    def draw(step, shard=None):
        return torch.randn(64, generator=randomness.noise_generator(step, shard=shard))

    streams = [draw(3), draw(3, 0), draw(3, 1), draw(4, 0), draw(0, 3)]
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            assert not torch.equal(a, b)
    assert torch.equal(draw(3, 1), draw(3, 1))  # one stream per (step, shard) within a run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_noise_is_opacus_draw_per_tensor(dtype):
    """The "ddp" reduction adds, to each tensor in turn, exactly what Opacus' `_generate_noise` draws from the step's
    generator (one draw per tensor, same order; sizes below and across the CPU kernel's 16-number blocks), then
    divides by L: seeded runs and the documented stream do not change with how the draws are buffered. Seen failing
    with one draw for all tensors split afterwards (a different stream)."""
    from opacus.optimizers.optimizer import _generate_noise

    from hf_dp_repr.privacy.reduction import NoisySum, reduction

    shapes = [(5,), (17, 3), (40,), (2, 2), (33,)]
    sums = [torch.randn(s, dtype=dtype) for s in shapes]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    step = NoisySum(params, [s.clone() for s in sums], noise_multiplier=1.3, max_grad_norm=0.7,
                    expected_batch_size=3, noise_generator=lambda device: torch.Generator().manual_seed(11))
    got = reduction("ddp")(step)
    generator = torch.Generator().manual_seed(11)
    want = [(s + _generate_noise(std=1.3 * 0.7, reference=s, generator=generator)) / 3 for s in sums]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
