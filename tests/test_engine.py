"""DPEngine (hf_dp_repr/privacy/engine.py): made from a PrivacyPlan alone, it drives DP-SGD without a Trainer, and the
plan is its one source of C, the clipping mode, σ and the batch."""

import logging

import pytest
import torch
from torch import nn

from hf_dp_repr.privacy.engine import DPEngine, EngineOptions
from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine
from hf_dp_repr.privacy.ledger import Phase, PrivacyLedger, PrivacyPlan
from hf_dp_repr.privacy.randomness import DPRandomness
from hf_dp_repr.privacy.reduction import REDUCTIONS, register_reduction, replicated

C, SIGMA, N, BATCH, SEED = 0.5, 0.7, 8, 4, 11


def plan(clipping="flat", phases=(Phase("train", SIGMA, BATCH / N, 3, BATCH),), **kw) -> PrivacyPlan:
    return PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=C, clipping=clipping,
                       dataset_size=N, poisson_sampling=True, phases=phases, randomness="seeded", **kw)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 3, generator=g) * 3, torch.randn(N, 1, generator=g)


def brute_force_update(net, rows, clipping, generator) -> list[torch.Tensor]:
    """(Σ_i clip(∇ loss_i) + N(0, σ²C²)) / B, one example at a time, clipped as the mode's formula says."""
    x, y = data()
    params = list(net.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in rows:
        grads = torch.autograd.grad(((net(x[i:i + 1]) - y[i:i + 1]) ** 2).sum(), params)
        norms = torch.stack([g.norm() for g in grads])
        whole = norms.norm()
        if clipping == "flat":
            factors = [min(1.0, C / (whole + 1e-6))] * len(grads)
        elif clipping == "automatic":
            factors = [C / (whole + 0.01)] * len(grads)
        else:  # per_layer: each tensor to C / sqrt(#tensors)
            factors = [min(1.0, C / len(grads) ** 0.5 / (n + 1e-6)) for n in norms]
        total = [t + f * g for t, f, g in zip(total, factors, grads)]
    noise = [torch.normal(0.0, SIGMA * C, p.shape, generator=generator) for p in params]
    return [(t + z) / BATCH for t, z in zip(total, noise)]


@pytest.mark.parametrize("clipper", ["ghost", "hooks"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_one_step_from_the_plan_alone_equals_the_brute_force_loop(clipper, clipping):
    net, (x, y) = model(), data()
    before = [p.detach().clone() for p in net.parameters()]
    engine = DPEngine(plan(clipping), EngineOptions(clipping_engine=clipper, micro_batches_per_step=2),
                      DPRandomness(noise_seed=SEED))
    optimizer = engine.start(torch.optim.SGD(net.parameters(), lr=1.0), net)
    micro = list(engine.batch_sampler())[:2]  # the first step's two micro-batches (Poisson, from the secret)
    assert engine.enter_phase() == 0 and engine.clipping_engine == clipper
    for rows in micro:
        if rows:
            with engine.recording(len(rows)):
                ((net(x[rows]) - y[rows]) ** 2).sum(1).sum().backward()
            engine.after_backward()
    optimizer.step()
    engine.detach(net)
    expected = brute_force_update(model(), [i for rows in micro for i in rows], clipping,
                                  DPRandomness(noise_seed=SEED).noise_generator(0))
    for old, new, update in zip(before, net.parameters(), expected):
        torch.testing.assert_close(old - new.detach(), update, rtol=1e-4, atol=1e-6)
    assert engine.ledger.steps_done == 1 and all(not hasattr(p, "_dp_name") for p in net.parameters())


def test_the_optimizer_takes_c_the_mode_sigma_and_the_batch_from_the_plan():
    two = (Phase("linear_probe", 2.0, 0.25, 1, 2), Phase("fine_tune", 1.5, 0.5, 2, 4))
    engine = DPEngine(plan("automatic", two), randomness=DPRandomness(noise_seed=SEED))
    optimizer = engine.start(torch.optim.SGD(model().parameters(), lr=0.1), model())
    assert (optimizer.max_grad_norm, optimizer.clipping) == (C, "automatic")
    seen = []
    for _ in range(3):  # empty steps: the noise alone
        seen.append((engine.enter_phase(), engine.enter_phase(), optimizer.noise_multiplier,
                     optimizer.expected_batch_size))
        optimizer.step()
    assert seen == [(0, None, 2.0, 2), (1, None, 1.5, 4), (None, None, 1.5, 4)]


def test_the_trainer_engine_follows_the_plan_not_arguments_changed_after_it(digits, tmp_path):
    """The engine (its optimizer) reads C and the clipping mode from the plan: arguments changed once the plan is
    made change nothing (before the engine, the optimizer read them from `args` and σ from the ledger)."""
    from hf_dp_repr import DPTrainer, DPTrainingArguments
    from hf_dp_repr.tiny import tiny_vit

    class ChangesArguments(DPTrainer):
        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            self.args.per_sample_max_grad_norm, self.args.clipping = 1e-3, "per_layer"
            return loader

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=2.0,
                               clipping="automatic", per_device_train_batch_size=16, max_steps=1, report_to="none",
                               save_strategy="no", disable_tqdm=True, noise_seed=1)
    trainer = ChangesArguments(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(64)))
    trainer.train()
    optimizer = trainer.engine.optimizer
    assert (optimizer.max_grad_norm, optimizer.clipping) == (2.0, "automatic") == (
        trainer.ledger.plan.per_sample_max_grad_norm, trainer.ledger.plan.clipping)


def test_epsilon_is_the_accountants_and_computed_once_per_step(monkeypatch):
    calls = []
    epsilon = PrivacyLedger.epsilon
    monkeypatch.setattr(PrivacyLedger, "epsilon", lambda self: calls.append(1) or epsilon(self))
    engine = DPEngine(plan(), randomness=DPRandomness(noise_seed=SEED))
    optimizer = engine.start(torch.optim.SGD(model().parameters(), lr=0.1), model())
    recorded = []
    engine.after_step.append(lambda ledger: recorded.append(ledger.steps_done))
    engine.enter_phase()
    optimizer.step()
    assert engine.epsilon() == engine.epsilon() == engine.plan.epsilon(1) and len(calls) == 1
    engine.enter_phase()
    optimizer.step()
    assert engine.epsilon() == engine.plan.epsilon(2) and len(calls) == 2 and recorded == [1, 2]


def test_the_reduction_is_a_replaceable_strategy_and_noise_streams_are_keyed_by_shard():
    seen = []

    @register_reduction("test_recording")
    def recording(step):
        seen.append((step.noise_multiplier, step.max_grad_norm, step.expected_batch_size, len(step.sums)))
        return replicated(step)

    try:
        engine = DPEngine(plan(), EngineOptions(reduction="test_recording"), DPRandomness(noise_seed=SEED))
        net = model()
        optimizer = engine.start(torch.optim.SGD(net.parameters(), lr=0.1), net)
        engine.enter_phase()
        optimizer.step()
        assert seen == [(SIGMA, C, BATCH, len(list(net.parameters())))]
    finally:
        del REDUCTIONS["test_recording"]
    with pytest.raises(ValueError, match="unknown reduction 'test_recording'"):
        EngineOptions(reduction="test_recording")
    randomness = DPRandomness(noise_seed=SEED)
    seeds = {shard: randomness.noise_generator(3, shard=shard).initial_seed() for shard in (None, 0, 1)}
    assert len(set(seeds.values())) == 3  # one stream per shard, none the unsharded one
    assert seeds[1] == DPRandomness(noise_seed=SEED).noise_generator(3, shard=1).initial_seed()


def test_ghost_engine_keys_pieces_through_key_of():
    """What sharding needs: the module holds another tensor in the backward (FSDP's gathered parameter) than the
    one the engine and the optimizer know; `key_of` maps it back, and norms and sums are keyed by the latter."""
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    reference = GhostClippingEngine(layer)
    with reference.recording():
        layer(x).pow(2).sum().backward()
    expected = reference.squared_norms()
    reference.remove()
    original = {"weight": layer.weight, "bias": layer.bias}
    engine = GhostClippingEngine(layer, key_of={(layer, n): p for n, p in original.items()})
    gathered = {n: nn.Parameter(p.detach().clone()) for n, p in original.items()}
    for name, p in gathered.items():  # swapped in, as FSDP2 does before the forward
        setattr(layer, name, p)
    with engine.recording():
        layer(x).pow(2).sum().backward()
    norms = engine.squared_norms()
    assert set(norms) == set(original.values())
    for name, p in original.items():
        torch.testing.assert_close(norms[p], expected[p])
    engine.remove()


def test_the_clipper_falls_back_with_its_reason_and_refuses_what_is_asked_for(caplog):
    by_unit = plan(privacy_unit="document")
    engine = DPEngine(by_unit, randomness=DPRandomness(noise_seed=SEED), log=logging.getLogger("test_engine"))
    with caplog.at_level(logging.WARNING, logger="test_engine"):
        engine.attach(model())
    assert engine.clipping_engine == "hooks" and "privacy_unit='document' clips the summed gradient" in caplog.text
    with pytest.raises(ValueError, match="clipping_engine='ghost' cannot clip this model exactly"):
        DPEngine(by_unit, EngineOptions(clipping_engine="ghost")).attach(model())


def test_the_engine_refuses_another_plans_randomness_or_ledger():
    with pytest.raises(ValueError, match="randomness is 'seeded'"):
        DPEngine(plan(), randomness=DPRandomness())
    other = PrivacyLedger(plan("automatic"))
    engine = DPEngine(plan(), randomness=DPRandomness(noise_seed=SEED))
    with pytest.raises(ValueError, match="another plan .clipping"):
        engine.start(torch.optim.SGD(model().parameters(), lr=0.1), model(), ledger=other)
