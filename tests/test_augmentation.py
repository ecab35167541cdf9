"""Augmentation multiplicity, `augmentation_multiplicity=k` (privacy/augmentation.py; issue 31 item 2): the training
set's own transform is read k times per sampled example, fresh at every step, and the mean of the k views' gradients
is clipped once; sampling and ε are those of k = 1."""

import random

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DataError, DPConfigError
from hf_dp_repr.privacy.augmentation import ViewsDataset
from hf_dp_repr.tiny import tiny_vit
from utils import CaptureUpdate  # p.grad right after the first DP step: the clipped, noised sum / expected batch


def _tensors(batch, scale=None):
    """A `set_transform` function: the rows as tensors, each image times `scale()` (None: unchanged)."""
    images = [torch.tensor(x, dtype=torch.float32) for x in batch["pixel_values"]]
    if scale is not None:
        images = [x * scale() for x in images]
    return {"pixel_values": images, "labels": batch["labels"]}


def _random(batch):  # a random augmentation: Gaussian pixel noise, from torch's global generator
    return {"pixel_values": [x + torch.randn(x.shape) for x in _tensors(batch)["pixel_values"]],
            "labels": batch["labels"]}


def _run(train, out, k, steps=1, callbacks=(), **overrides):
    kwargs = dict(output_dir=str(out), noise_multiplier=0.5, target_delta=1e-3, accountant="rdp", max_steps=steps,
                  per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=0.1, optim="sgd",
                  report_to="none", disable_tqdm=True, seed=0, noise_seed=3, save_strategy="no",
                  augmentation_multiplicity=k)
    kwargs.update(overrides)
    trainer = DPTrainer(model=tiny_vit(), args=DPTrainingArguments(**kwargs), train_dataset=train,
                        callbacks=list(callbacks))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def rows(digits):
    return digits["train"].select(range(32)).with_format(None)


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
@pytest.mark.parametrize("clip", [0.01, 1e4])  # every example clipped (grouping matters), none (the 1/k mean matters)
def test_k_identical_views_give_the_update_of_k_equal_1(rows, tmp_path, engine, clip):
    train = rows.with_transform(_tensors)  # deterministic: the k views of an example are equal
    got = {}
    for k in (1, 4):
        capture = CaptureUpdate()
        _run(train, tmp_path / str(k), k, callbacks=[capture], clipping_engine=engine, per_sample_max_grad_norm=clip)
        got[k] = capture.grads
    for name, g in got[1].items():
        torch.testing.assert_close(got[4][name], g, rtol=1e-5, atol=1e-9)


def test_the_transform_runs_k_times_per_sampled_example(rows, tmp_path):
    calls = []

    def counting(batch):
        calls.append(len(batch["labels"]))
        return _random(batch)

    class Window(TrainerCallback):  # only the calls of the training steps (not the checks before training)
        def on_train_begin(self, args, state, control, **kwargs):
            calls.clear()

    trainer = _run(rows.with_transform(counting), tmp_path, 3, steps=2, callbacks=[Window()])
    sampler = trainer.engine.sampler
    sampler.set_epoch(0)
    sampled = sum(len(chunk) for chunk in list(sampler)[:4])  # 2 steps of 2 micro-batches
    assert sampled > 0 and sum(calls) == 3 * sampled


def test_views_are_reproducible_from_the_seed_and_leave_the_global_generators_alone(rows):
    views = ViewsDataset(rows.with_transform(_random), seed=0)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    a, b, c = views[(5, (0, 0, 5, 0))], views[(5, (0, 0, 5, 0))], views[(5, (0, 0, 5, 1))]
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and not torch.equal(a["pixel_values"], c["pixel_values"])
    other = ViewsDataset(rows.with_transform(_random), seed=1)[(5, (0, 0, 5, 0))]
    assert not torch.equal(a["pixel_values"], other["pixel_values"])  # the public seed, not a fixed stream
    assert torch.equal(torch.get_rng_state(), states[0]) and (np.random.get_state()[1] == states[1]).all()
    assert random.getstate() == states[2]
    # a micro-batch read whole (torch's DataLoader calls __getitems__): the same views, the generators put back
    keys = [(5, (0, 0, 5, 0)), (5, (0, 0, 5, 1)), (2, (0, 0, 2, 0))]
    batch = views.__getitems__(keys)
    assert all(torch.equal(x["pixel_values"], views[k]["pixel_values"]) for x, k in zip(batch, keys))
    assert torch.equal(batch[0]["pixel_values"], a["pixel_values"]) and torch.equal(torch.get_rng_state(), states[0])


def test_a_row_gets_the_same_views_however_its_step_is_split_over_micro_batches_and_processes():
    """The views' key is (epoch, step, row, view): the same for one process and for each rank of two (a sharded run
    compares with one process in tests/test_sharding.py); keyed by micro-batch, rows of a step that a rank's split
    puts in another micro-batch got other views."""
    from hf_dp_repr.privacy.augmentation import ViewsBatchSampler
    from hf_dp_repr.privacy.sampler import PoissonBatchSampler

    def keys(world, rank):
        batches = PoissonBatchSampler(num_samples=200, sample_rate=0.1, steps_per_epoch=4, micro_batches_per_step=3,
                                      world_size=world, rank=rank, seed=7)
        batches.set_epoch(2)
        return {key for micro_batch in ViewsBatchSampler(batches, 2) for key in micro_batch}

    one = keys(1, 0)
    assert len(one) > 50 and one == keys(2, 0) | keys(2, 1)


def test_replacing_one_example_moves_the_clipped_sum_by_at_most_2c_whatever_its_views(rows, tmp_path):
    """Adversarial views: each view scaled by a random factor up to 1000 (every view's gradient far above C, all
    pointing the same way); a full batch (q = 1), no noise, so the update is the clipped sum / n."""
    clip, n, k = 1.0, 16, 4
    gen = torch.Generator().manual_seed(0)

    def adversarial(batch):
        return _tensors(batch, scale=lambda: 1 + 999 * torch.rand((), generator=gen))

    base = rows.select(range(n))
    other = base.to_dict()
    other["pixel_values"][0], other["labels"][0] = rows[20]["pixel_values"], rows[20]["labels"]
    assert other["labels"][0] != base[0]["labels"]
    sums = []
    for i, data in enumerate((base, type(base).from_dict(other))):
        capture = CaptureUpdate()
        _run(data.with_transform(adversarial), tmp_path / str(i), k, callbacks=[capture], noise_multiplier=0.0,
             per_device_train_batch_size=n, gradient_accumulation_steps=1, per_sample_max_grad_norm=clip)
        sums.append({name: g * n for name, g in capture.grads.items()})
    moved = torch.sqrt(sum(((sums[0][p] - sums[1][p]).double() ** 2).sum() for p in sums[0])).item()
    assert 0.5 * clip < moved <= 2 * clip * (1 + 1e-5)


def test_epsilon_and_sampling_are_those_of_k_equal_1_in_every_combination(digits, rows, tmp_path):
    from utils import user_dataset

    train = rows.with_transform(_random)
    one = _run(train, tmp_path / "one", 1, steps=2)
    for name, overrides in {"LP→FT, ghost": dict(trainable_blocks=1, lp_steps=1, clipping_engine="ghost"),
                            "groups, hooks": dict(trainable_groups="biases,head", clipping_engine="hooks")}.items():
        trainer = _run(train, tmp_path / name, 3, steps=2, **overrides)
        assert trainer.epsilon() == pytest.approx(one.epsilon()), name
    users = user_dataset(digits).with_format(None).with_transform(_random)  # (the unit column is read without it)
    unit_run = _run(users, tmp_path / "units", 2, steps=2, privacy_unit="user_id", per_device_train_batch_size=2,
                    remove_unused_columns=False)
    assert unit_run.ledger.steps_done == 2 and unit_run.engine.clipping_engine == "hooks"


def test_what_cannot_work_is_refused_before_any_work(rows, tmp_path):
    with pytest.raises(DataError, match="no transform"):
        _run(rows.with_format("torch"), tmp_path / "a", 2)
    assert not (tmp_path / "a").exists()
    common = dict(output_dir="unused", noise_multiplier=1.0, report_to="none")
    with pytest.raises(DPConfigError, match="augmentation_multiplicity"):
        DPTrainingArguments(augmentation_multiplicity=0, **common)
    with pytest.raises(DPConfigError, match="cannot be cached"):
        DPTrainingArguments(augmentation_multiplicity=2, cache_features=True, trainable_blocks=0, **common)
