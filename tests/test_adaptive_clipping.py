"""Adaptive clipping (hf_dp_repr/privacy/adaptive_clipping.py; issue 42): C follows a quantile of the per-example
norms from a noisy count that shares σ with the gradient. The C sequence and each step's clipped sum against a float64
brute force (the count's and the gradient's noise replayed from the seeded secret), the sensitivity of the count and
the clipped sum, ε against dp_accounting, resume exactness, the log, the ledger and the card, and the refusals."""

import json
import math

import pytest
import torch
from torch import nn

from hf_dp_repr import DPTrainer, DPTrainingArguments, PrivacyLedger
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.privacy.adaptive_clipping import AdaptiveClipping, gradient_noise_multiplier
from hf_dp_repr.privacy.engine import DPEngine, EngineOptions
from hf_dp_repr.privacy.ledger import Phase, PrivacyPlan
from hf_dp_repr.privacy.randomness import DPRandomness

C0, N, BATCH, STEPS, SEED = 0.5, 8, 4, 5, 11
SPEC = dict(quantile=0.5, learning_rate=0.3)


def plan(sigma, count_noise, batch=BATCH, steps=STEPS, n=N, unit="row") -> PrivacyPlan:
    return PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=C0, clipping="flat",
                       dataset_size=n, poisson_sampling=True, phases=[Phase("train", sigma, batch / n, steps, batch)],
                       randomness="seeded", privacy_unit=unit,
                       adaptive_clipping=AdaptiveClipping(**SPEC, count_noise=count_noise))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 3, generator=g) * 3, torch.randn(N, 1, generator=g)


def run_engine(the_plan, clipper="ghost", micro=2, x=None, y=None, units=None):
    """The plan's steps through DPEngine alone (`units`: each row's unit index, with a privacy unit); returns (the rows
    of each step, the weights before each step, the weights after the last, the engine)."""
    net = model()
    if x is None:
        x, y = data()
    engine = DPEngine(the_plan, EngineOptions(clipping_engine=clipper, micro_batches_per_step=micro),
                      DPRandomness(noise_seed=SEED))
    optimizer = engine.start(torch.optim.SGD(net.parameters(), lr=0.5), net)
    chunks = list(engine.batch_sampler(None if units is None else torch.as_tensor(units).numpy()))
    steps, weights = [], []
    for t in range(the_plan.planned_steps):
        engine.enter_phase()
        weights.append([p.detach().clone() for p in net.parameters()])
        rows_of_step = []
        for rows in chunks[t * micro:(t + 1) * micro]:
            if rows:
                with engine.recording(len(rows)):
                    ((net(x[rows]) - y[rows]) ** 2).sum().backward()
                engine.after_backward(None if units is None else torch.as_tensor(units)[list(rows)])
                rows_of_step += list(rows)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(rows_of_step)
    engine.detach(net)
    return steps, weights, [p.detach() for p in net.parameters()], engine


def example_grads(weights, rows, x, y):
    """Each example's gradient alone, in float64."""
    net = model().double()
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights):
            p.copy_(w.double())
    out = []
    for i in rows:
        loss = ((net(x[i:i + 1].double()) - y[i:i + 1].double()) ** 2).sum()
        out.append(torch.autograd.grad(loss, list(net.parameters())))
    return out


def brute_force(the_plan, steps, weights, x, y, units=None):
    """Replays the run in float64: each step's clipped sum with that step's C, the gradient noise σ_eff·C from the
    step's stream, the count Σ(b_i − 1/2) + N(0, σ_b²) from the count's stream, and C ← C·exp(−η(b̃ − γ))."""
    spec, (phase,) = the_plan.adaptive_clipping, the_plan.phases
    sigma, batch = phase.noise_multiplier, phase.expected_batch_size
    sigma_eff = gradient_noise_multiplier(sigma, spec.count_noise)
    secret, c, cs, updates = DPRandomness(noise_seed=SEED), C0, [], []
    for t, (rows, w) in enumerate(zip(steps, weights)):
        grads = example_grads(w, rows, x, y)
        if units is not None:  # a unit's gradient: the sum of its rows'; one norm, one count, one clip per unit
            by_unit = {}
            for i, g in zip(rows, grads):
                held = by_unit.get(units[i])
                by_unit[units[i]] = g if held is None else [a + b for a, b in zip(held, g)]
            grads = list(by_unit.values())
        total = [torch.zeros_like(p, dtype=torch.float64) for p in w]
        count = 0.0
        for g in grads:
            norm = math.sqrt(sum(float((gi ** 2).sum()) for gi in g))
            count += (1.0 if norm <= c else 0.0) - 0.5
            total = [s + min(1.0, c / (norm + 1e-6)) * gi for s, gi in zip(total, g)]
        if sigma > 0:
            gen = secret.noise_generator(t)
            total = [s + torch.normal(0.0, sigma_eff * c, s.shape, generator=gen).double() for s in total]
        updates.append([s / batch for s in total])
        if spec.count_noise > 0:
            count += float(torch.normal(0.0, spec.count_noise, (1,), generator=secret.count_noise_generator(t),
                                        dtype=torch.float64))
        c = c * math.exp(-spec.learning_rate * (count / batch + 0.5 - spec.quantile))
        cs.append(c)
    return cs, updates


@pytest.mark.parametrize("clipper", ["ghost", "hooks"])
@pytest.mark.parametrize("sigma, count_noise", [(0.0, 0.0), (0.8, 0.6)])
def test_c_sequence_and_each_steps_clipped_sum_equal_a_float64_brute_force(clipper, sigma, count_noise):
    """σ = σ_b = 0: the C sequence computed by hand from the per-example norms; σ, σ_b > 0: the same with both noises
    replayed from the seeded secret (the gradient's std is σ_eff·C of that step, the count's its own stream)."""
    x, y = data()
    the_plan = plan(sigma, count_noise)
    steps, weights, final, engine = run_engine(the_plan, clipper)
    want_cs, updates = brute_force(the_plan, steps, weights, x, y)
    assert engine.ledger.clip_norms == pytest.approx(want_cs, rel=1e-9)
    assert len(set(engine.ledger.clip_norms)) >= 2  # C moved (it stays where b̃ = γ exactly, σ_b = 0)
    for t in range(STEPS):  # the applied update of step t: w_t − w_{t+1} = lr · grad_t
        after = weights[t + 1] if t + 1 < STEPS else final
        for w0, w1, u in zip(weights[t], after, updates[t]):
            torch.testing.assert_close((w0 - w1).double() / 0.5, u, rtol=1e-4, atol=1e-6)


def test_with_a_privacy_unit_each_unit_is_counted_once_by_its_summed_norm():
    """Units of 1 to 3 rows (the hooks engine: a unit may span micro-batches): the C sequence and the updates of the
    float64 brute force on per-unit summed gradients."""
    units = [0, 0, 1, 2, 2, 2, 3, 4]
    x, y = data()
    the_plan = plan(0.8, 0.6, batch=2, n=5, unit="user")
    steps, weights, final, engine = run_engine(the_plan, "hooks", units=units)
    want_cs, updates = brute_force(the_plan, steps, weights, x, y, units)
    assert engine.ledger.clip_norms == pytest.approx(want_cs, rel=1e-9)
    for t in range(STEPS):
        after = weights[t + 1] if t + 1 < STEPS else final
        for w0, w1, u in zip(weights[t], after, updates[t]):
            torch.testing.assert_close((w0 - w1).double() / 0.5, u, rtol=1e-4, atol=1e-6)


def test_accumulation_does_not_change_the_c_sequence():
    """The count is summed over the micro-batches of a step: 1, 2 or 4 micro-batches give the same C (same batches:
    the sampler draws each step's logical batch, then splits it)."""
    one = run_engine(plan(0.8, 0.6), micro=1)[3].ledger.clip_norms
    assert run_engine(plan(0.8, 0.6), micro=4)[3].ledger.clip_norms == pytest.approx(one, rel=1e-6)


def _one_step_release(x, y):
    """(count Σ(b_i − 1/2), clipped sum) of one full-batch step at σ = σ_b = 0 (recovered from C and the update)."""
    the_plan = plan(0.0, 0.0, batch=len(x), steps=1, n=len(x))  # q = 1: every example in the step
    _, weights, final, engine = run_engine(the_plan, micro=1, x=x, y=y)
    c1 = engine.ledger.clip_norms[0]
    fraction = SPEC["quantile"] - math.log(c1 / C0) / SPEC["learning_rate"]
    clipped_sum = torch.cat([((w0 - w1) / 0.5 * len(x)).flatten() for w0, w1 in zip(weights[0], final)])
    return (fraction - 0.5) * len(x), clipped_sum


def test_replace_one_moves_the_count_by_at_most_one_and_the_clipped_sum_by_at_most_2c():
    x, y = data()
    count, total = _one_step_release(x, y)
    g = torch.Generator().manual_seed(5)
    moved = []
    for scale in (0.01, 1.0, 100.0):  # the replacement clipped or not, whatever the one it replaces was
        for i in range(N):
            x2, y2 = x.clone(), y.clone()
            x2[i], y2[i] = torch.randn(3, generator=g) * scale, torch.randn(1, generator=g) * scale
            count2, total2 = _one_step_release(x2, y2)
            assert abs(count2 - count) <= 1 + 1e-6
            assert (total2 - total).norm() <= 2 * C0 * (1 + 1e-5)
            moved.append(abs(count2 - count))
    assert max(moved) == pytest.approx(1.0, abs=1e-6)  # the bound is met: a clipped example replaced by one that is not


def test_add_remove_moves_the_count_by_exactly_one_half():
    x, y = data()
    count, total = _one_step_release(x, y)
    count2, total2 = _one_step_release(x[1:], y[1:])  # example 0 removed
    assert abs(abs(count2 - count) - 0.5) < 1e-6 and (total2 - total).norm() <= C0 * (1 + 1e-5)


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_epsilon_equals_dp_accountings_for_the_gradient_and_the_count_together(neighboring):
    """The ledger states σ, σ_b and σ_eff; its ε is dp_accounting's: for a full batch, the composition of the two
    Gaussian mechanisms as released (gradient: σ_eff per unit of sensitivity; count: σ_b for ±1/2, i.e. 2σ_b), and for
    a Poisson batch the subsampled Gaussian of the σ they add up to."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    relation = dp_accounting.NeighboringRelation
    relation = relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE
    for q, steps in ((1.0, 3), (0.25, 10)):
        the_plan = PrivacyPlan(accountant="pld", target_delta=1e-5, per_sample_max_grad_norm=C0, clipping="flat",
                               dataset_size=400, poisson_sampling=True,
                               phases=[Phase("train", 1.3, q, steps, int(q * 400))], neighboring=neighboring,
                               adaptive_clipping=AdaptiveClipping(count_noise=2.0))
        ledger = PrivacyLedger(the_plan, steps, clip_norms=(1.0,) * steps)
        stated = ledger.to_dict()
        sigma_eff, sigma_b = stated["gradient_noise_multipliers"][0], stated["adaptive_clipping"]["count_noise"]
        assert stated["phases"][0]["noise_multiplier"] == 1.3 and sigma_b == 2.0
        assert sigma_eff == pytest.approx((1.3 ** -2 - 4.0 ** -2) ** -0.5) and sigma_eff > 1.3
        acc = PLDAccountant(relation, value_discretization_interval=1e-3)  # the ledger's grid (pld_discretization)
        if q == 1.0:
            acc.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma_eff),
                                                       dp_accounting.GaussianDpEvent(2 * sigma_b)]), steps)
        else:
            joint = (sigma_eff ** -2 + (2 * sigma_b) ** -2) ** -0.5
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(joint)), steps)
        assert ledger.epsilon() == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)
        assert stated["epsilon"] == pytest.approx(ledger.epsilon())


# ---- through DPTrainer: arguments, calibration, the log, the ledger, resume, the card -------------------------------
def _args(out, **kw):
    base = dict(output_dir=str(out), target_epsilon=8.0, target_delta=1e-3, max_steps=6,
                per_device_train_batch_size=32, learning_rate=1e-3, report_to="none", disable_tqdm=True, seed=0,
                noise_seed=5, adaptive_clipping="quantile=0.5,learning_rate=0.2,count_noise=8",
                per_sample_max_grad_norm=0.01, logging_steps=1, save_strategy="no")
    return DPTrainingArguments(**{**base, **kw})


@pytest.fixture
def data128(digits):
    return digits["train"].select(range(128))


def test_a_trainer_run_calibrates_sigma_for_both_and_logs_and_records_c(data128, tmp_path):
    from hf_dp_repr.tiny import tiny_vit

    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=data128)
    trainer.train()
    trainer.save_model()  # the weights, the ledger and the card
    led = trainer.ledger
    assert trainer.epsilon() == pytest.approx(8.0, rel=2e-3)  # target_epsilon calibrates the total σ
    sigma = led.plan.phases[0].noise_multiplier
    assert trainer.engine.optimizer.noise_multiplier == pytest.approx((sigma ** -2 - 16.0 ** -2) ** -0.5)
    logged = [h["clip_norm"] for h in trainer.state.log_history if "loss" in h]  # one line per step
    assert logged == list(led.clip_norms) and len(logged) == 6
    assert led.clip_norms[-1] > 0.02  # from a C far below the norms, C grows (≥ 1.1× a step while all are clipped)
    saved = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert saved["clip_norms"] == list(led.clip_norms) and saved["adaptive_clipping"]["count_noise"] == 8.0
    card = (tmp_path / "README.md").read_text()
    assert "| adaptive clipping | C from 0.01 (initial) to " in card
    assert f"to {led.clip_norms[-1]:.4g} (final), following the 0.5 quantile" in card


def test_resume_continues_the_c_sequence_exactly(data128, tmp_path):
    from hf_dp_repr.tiny import tiny_vit

    straight = DPTrainer(model=tiny_vit(), args=_args(tmp_path / "a"), train_dataset=data128)
    straight.train()
    from utils import StopAt

    first = DPTrainer(model=tiny_vit(), args=_args(tmp_path / "b", save_strategy="steps", save_steps=3),
                      train_dataset=data128, callbacks=[StopAt(3)])
    first.train()
    resumed = DPTrainer(model=tiny_vit(), args=_args(tmp_path / "b", save_strategy="steps", save_steps=3),
                        train_dataset=data128)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.steps_done == 6
    assert resumed.ledger.clip_norms == straight.ledger.clip_norms


def test_refusals_before_any_work(data128, tmp_path):
    from hf_dp_repr.tiny import tiny_vit

    with pytest.raises(DPConfigError, match="clipping='flat'"):
        _args(tmp_path, clipping="per_layer")
    with pytest.raises(DPConfigError, match="keys"):
        _args(tmp_path, adaptive_clipping="quantile=0.5,eta=1")
    with pytest.raises(DPConfigError, match="quantile=1.5"):
        _args(tmp_path, adaptive_clipping="quantile=1.5")
    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path / "small", adaptive_clipping="count_noise=0.1"),
                        train_dataset=data128)
    with pytest.raises(DPConfigError, match="2σ_b > σ"):
        trainer.train()
    assert not (tmp_path / "small").exists() or not any((tmp_path / "small").iterdir())


def test_count_share_sets_sigma_b_from_the_calibrated_sigma(tmp_path):
    """count_share=0.1: (2σ_b)⁻² = 0.1·σ⁻², so σ_eff = σ/√0.9, whatever σ the plan has."""
    from hf_dp_repr.training.plan import plan_run

    args = _args(tmp_path, adaptive_clipping="count_share=0.1", target_epsilon=None, noise_multiplier=14.3,
                 per_device_train_batch_size=128)  # (the demo's σ at ε = 1, where σ_b = 128/20 is refused)
    the_plan = plan_run(args, dataset_size=1000)
    sigma = the_plan.phases[0].noise_multiplier
    assert the_plan.adaptive_clipping.count_noise == pytest.approx(sigma / (2 * 0.1 ** 0.5))
    assert the_plan.gradient_noise_multiplier(0) == pytest.approx(sigma / 0.9 ** 0.5)
    with pytest.raises(DPConfigError, match="not both"):
        plan_run(_args(tmp_path, adaptive_clipping="count_share=0.1,count_noise=3", target_epsilon=None,
                       noise_multiplier=1.0), dataset_size=1000)
