"""privacy_unit: rows sharing a column value are one unit, sampled, clipped and accounted as one contribution.

The brute-force checks run one σ = 0 step with sample rate q = 1 (every unit in the batch), so the update on a
dataset and on its neighbour without one unit can be compared without coupling the Poisson draws:
    Σ-update(D) − Σ-update(D − u) = clip_C(Σ_{rows r of u} ∇loss_r),   with norm ≤ C  (update = Σ-update / L).
A per-row clipping (the bug this feature fixes) lets a unit of k rows move the sum by up to k·C.
"""

import numpy as np
import pytest
import torch
from datasets import Dataset

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.hub.card import write_model_card
from hf_dp_repr.privacy.units import UnitPoissonBatchSampler, describe_unit, sum_per_unit, unit_rows
from hf_dp_repr.tiny import tiny_vit
from utils import USERS, CaptureUpdate, brute_force_unit_sum, norm_of_difference, user_dataset


def summed_update(dataset, tmp_path, per_device, accumulation, clip, name="run", **kw):
    """L × the σ = 0 update of one DP step with privacy_unit='user_id' (q = 1: every unit)."""
    capture = CaptureUpdate()
    args = DPTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation, max_steps=1, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        privacy_unit="user_id", learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=3, noise_seed=3, target_delta=1e-3, **kw)
    trainer = DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=dataset, callbacks=[capture])
    trainer.train()
    assert trainer.ledger.plan.phases[0].sample_rate == 1.0
    L = trainer.ledger.expected_batch_size
    return {n: g * L for n, g in capture.grads.items()}, trainer


def test_unit_gradients_are_summed_then_clipped_across_micro_batches(digits, tmp_path):
    """6 units, 3 per device × 2 micro-batches: 'big' (11 of 20 rows) spans micro-batches; the DP sum equals the
    brute-force sum of per-user clipped gradients. C = 2 sits among the users' gradient norms."""
    data = user_dataset(digits)
    got, trainer = summed_update(data, tmp_path, per_device=3, accumulation=2, clip=2.0)
    want = brute_force_unit_sum(data, 2.0)
    rel = norm_of_difference(got, want) / torch.sqrt(sum((w.double() ** 2).sum() for w in want.values())).item()
    assert rel < 1e-4
    assert trainer.ledger.plan.dataset_size == 6 and trainer.ledger.plan.privacy_unit == "user_id"


@pytest.mark.parametrize("removed", ["big", "solo"])
def test_removing_a_unit_moves_the_sigma0_update_by_at_most_C_over_L(removed, digits, tmp_path):
    """Brute force over the neighbouring dataset: with a small C every unit is clipped, so the sum moves by
    exactly C when a unit goes (by 11·C for 'big' if rows were clipped one by one)."""
    clip = 0.05
    full, _ = summed_update(user_dataset(digits), tmp_path, per_device=3, accumulation=2, clip=clip, name="full")
    rest = [u for u in USERS if u != removed]
    keep = [i for i, u in enumerate(USERS) if u != removed]
    neighbour = user_dataset(digits).select(keep)
    assert list(neighbour["user_id"]) == rest
    less, trainer = summed_update(neighbour, tmp_path, per_device=5, accumulation=1, clip=clip, name="less")
    assert trainer.ledger.plan.dataset_size == 5
    assert norm_of_difference(full, less) <= clip * (1 + 1e-4)
    assert norm_of_difference(full, less) >= clip * 0.99  # the unit did contribute: the bound is tight here


def test_unit_column_works_without_removing_unused_columns(digits, tmp_path):
    """remove_unused_columns=False: the (string) unit column is still consumed, never reaches the model."""
    data = user_dataset(digits)
    got, _ = summed_update(data, tmp_path, per_device=6, accumulation=1, clip=2.0, remove_unused_columns=False)
    want = brute_force_unit_sum(data, 2.0)
    assert norm_of_difference(got, want) < 1e-4 * torch.sqrt(sum((w ** 2).sum() for w in want.values())).item()


def test_sampler_draws_units_whole_contiguous_and_caps_rows_with_the_secret_seed():
    row_unit, n_units = unit_rows(["a", "b", "a", "c", "a", "b", "a", "a"])
    kw = dict(row_unit=row_unit, num_units=n_units, sample_rate=1.0, steps_per_epoch=3, micro_batches_per_step=2)
    batches = list(UnitPoissonBatchSampler(**kw, seed=1))
    for step in range(3):
        rows = batches[2 * step] + batches[2 * step + 1]
        units = [int(row_unit[r]) for r in rows]
        assert sorted(set(units)) == [0, 1, 2]  # q = 1: every unit, with all its rows
        assert sorted(rows) == list(range(8))
        changes = sum(a != b for a, b in zip(units, units[1:]))
        assert changes == 2  # contiguous: each unit is one run of rows
    capped = [list(UnitPoissonBatchSampler(**kw, max_rows_per_unit=2, seed=s)) for s in range(6)]
    for draw in capped:
        rows = draw[0] + draw[1]
        assert sum(row_unit[r] == 0 for r in rows) == 2 and len(rows) == 5
    subsets = {tuple(sorted(d[0] + d[1])) for d in capped}
    assert len(subsets) > 1  # the subset comes from the (secret) sampling seed


def test_sampler_sample_rate_is_over_units():
    row_unit = np.repeat(np.arange(200), 5)  # 200 units of 5 rows
    sampler = UnitPoissonBatchSampler(row_unit, 200, sample_rate=0.1, steps_per_epoch=400, seed=0)
    sizes = [len(b) for b in sampler]
    assert all(s % 5 == 0 for s in sizes)
    assert np.mean(sizes) / 5 == pytest.approx(20, rel=0.05)


def test_sum_per_unit_keeps_the_order_of_first_rows():
    grads = [torch.arange(5.0)[:, None]]
    ids, sums = sum_per_unit(grads, torch.tensor([9, 2, 9, 5, 2]))
    assert ids.tolist() == [9, 2, 5] and sums[0].flatten().tolist() == [2.0, 5.0, 3.0]


def test_card_ledger_and_logs_name_the_unit(digits, tmp_path, caplog):
    data = user_dataset(digits)
    args = DPTrainingArguments(output_dir=str(tmp_path / "card"), per_device_train_batch_size=2, max_steps=2,
                               target_epsilon=8.0, target_delta=1e-3, privacy_unit="user_id", report_to="none",
                               save_strategy="no", disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=data)
    with caplog.at_level("INFO"):  # the plan is an INFO line
        trainer.train()
    led = trainer.ledger
    assert led.plan.dataset_size == 6 and led.sample_rate == pytest.approx(2 / 6) and led.plan.privacy_unit == "user_id"
    assert "unit of privacy: one user (all rows sharing a user_id), 6 units" in caplog.text
    trainer.save_model()
    card = write_model_card(trainer, args.output_dir).content
    assert "| unit of privacy | one user (all rows sharing a user_id) |" in card
    assert "user_id-level (ε, δ)-DP" in card and "6 units" in card


def test_describe_unit():
    assert describe_unit("document_id") == "one document (all rows sharing a document_id)"
    assert describe_unit("row") == "one example (row)"


def test_missing_or_absent_unit_column_is_refused_before_training(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path / "x"), target_epsilon=1.0, privacy_unit="user_id",
                               report_to="none")
    with pytest.raises(ValueError, match="privacy_unit='user_id' but the training set has no such column"):
        DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=digits["train"].select(range(8)))
    holes = user_dataset(digits, ["a", None, "b", "a"])
    with pytest.raises(ValueError, match="missing value"):
        DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=holes)
    assert not (tmp_path / "x").exists()


def test_unit_ids_of_a_torch_formatted_dataset_are_values_not_tensors(digits):
    """A torch-formatted int column gives 0-d tensors, which hash by identity: every row would be its own unit."""
    from hf_dp_repr.privacy.units import column_values

    data = Dataset.from_dict({"x": [0, 1, 2, 3], "document_id": [5, 5, 6, 5]}).with_format("torch")
    assert unit_rows(column_values(data, "document_id"))[1] == 2
    as_dicts = [dict(row) for row in data]  # a plain map-style dataset of dicts holding tensors
    assert unit_rows(column_values(as_dicts, "document_id"))[1] == 2


def test_delta_is_checked_against_the_number_of_units(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path / "d"), target_epsilon=1.0, target_delta=0.2,
                               privacy_unit="user_id", report_to="none")
    with pytest.raises(DPConfigError, match=r"n=6 training units"):
        DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=user_dataset(digits))


# ---- sharded runs: each micro-batch holds whole units, which the ghost engine clips as one --------------------------
def test_whole_units_sampler_cuts_micro_batches_only_between_units():
    """whole_units=True (sharded runs): the same units and rows per step as the default split, in micro-batches that
    never cut a unit; the default (unsharded) split is unchanged and does cut."""
    row_unit = np.repeat(np.arange(30), np.arange(30) % 4 + 1)  # units of 1..4 rows
    kw = dict(row_unit=row_unit, num_units=30, sample_rate=0.4, steps_per_epoch=20, micro_batches_per_step=3, seed=4)
    cut, whole = list(UnitPoissonBatchSampler(**kw)), list(UnitPoissonBatchSampler(**kw, whole_units=True))
    assert len(whole) == len(cut) == 60
    cuts_a_unit = 0
    for step in range(20):
        plain, mine = cut[3 * step: 3 * step + 3], whole[3 * step: 3 * step + 3]
        assert sum(plain, []) == sum(mine, [])  # the same rows in the same order
        seen = [{int(row_unit[r]) for r in micro} for micro in mine]
        assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])  # no unit in two micro-batches
        assert all(len(m) <= 4 + len(sum(mine, [])) / 3 for m in mine)  # near an even split
        cuts_a_unit += any({int(row_unit[r]) for r in a} & {int(row_unit[r]) for r in b}
                           for a, b in zip(plain, plain[1:]))
    assert cuts_a_unit > 0  # the default split does cut units (the hooks engine carries them over)


UNIT_OF_ROW = torch.tensor([7, 3, 7, 9, 7, 3])  # units of 3, 2 and 1 rows, in no particular order


def unit_case(kind: str, dtype):
    """A tiny GPT-2 (tied wte/lm_head) on right-padded rows of different lengths (unit 7's rows: 12, 7 and 2 real
    tokens), or a tiny ViT; 6 rows."""
    from hf_dp_repr.tiny import tiny_gpt2

    g = torch.Generator().manual_seed(0)
    if kind == "vit":
        model = tiny_vit(num_labels=3, seed=0)
        inputs, labels = {"pixel_values": torch.randn(6, 1, 8, 8, generator=g)}, torch.randint(0, 3, (6,), generator=g)
    else:
        model = tiny_gpt2(seed=0)
        mask = (torch.arange(12)[None] < torch.tensor([12, 3, 7, 5, 2, 9])[:, None]).long()
        ids = torch.randint(1, 120, (6, 12), generator=g) * mask
        inputs, labels = {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return model.to(dtype).train(), inputs, labels


def row_losses(model, inputs, labels):
    from hf_dp_repr.privacy.grad_samplers import batch_position_ids
    from hf_dp_repr.privacy.loss import is_causal_lm, per_example_loss

    inputs = dict(inputs)
    batch_position_ids(model, inputs)
    return per_example_loss(model(**inputs).logits, labels, shift_labels=is_causal_lm(model))


def per_unit_gradients(model, inputs, labels):
    """(trained tensors, each unit's summed gradient in the order of torch.unique(UNIT_OF_ROW)), each row alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(row_losses(model, {k: v[i:i + 1] for k, v in inputs.items()}, labels[i:i + 1]).sum(),
                                params) for i in range(len(labels))]
    return params, [[sum(g[j] for g, u in zip(rows, UNIT_OF_ROW.tolist()) if u == unit) for j in range(len(params))]
                    for unit in torch.unique(UNIT_OF_ROW).tolist()]


def relative(got: list, want: list, scale: float = 0.0) -> float:
    """The largest error relative to the largest wanted value, or to `scale` when larger (a tensor whose gradient is
    zero up to rounding, ~1e-36 for ViT here, is compared at the scale of the others)."""
    return max((a - b).abs().max().item() for a, b in zip(got, want)) / max(scale, *(b.abs().max().item()
                                                                                  for b in want))


@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_ghost_norms_and_clipped_sum_of_units_equal_a_per_unit_brute_force(kind):
    """float64: ||Σ_{rows of u} G_r||² per unit and tensor (Gram cross terms between a unit's rows, explicit pieces
    summed per unit), and the clipped sum with each row given its unit's factor, equal the brute force."""
    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine

    model, inputs, labels = unit_case(kind, torch.float64)
    params, per_unit = per_unit_gradients(model, inputs, labels)
    engine = GhostClippingEngine(model)
    with engine.recording(len(labels)):
        row_losses(model, inputs, labels).sum().backward()
    _, groups = torch.unique(UNIT_OF_ROW, return_inverse=True)
    norms = engine.squared_norms(groups)
    assert kind == "vit" or {p for p in params if p.dim() == 2} - engine.explicit  # the Gram path is exercised
    brute = [torch.stack([g[j].pow(2).sum() for g in per_unit]) for j in range(len(params))]
    scale = max(b.max().item() for b in brute)
    for j, p in enumerate(params):
        assert relative([norms[p]], [brute[j]], scale) <= 1e-10, j
    total = sum(norms[p] for p in params).sqrt()
    c = (total.median() / (total + 1e-6)).clamp(max=1.0)
    assert (c < 1).any() and (c == 1).any()
    sums = engine.clipped_sums({p: c[groups] for p in params})
    assert relative([sums[p] for p in params], [sum(c[u] * g[j] for u, g in enumerate(per_unit))
                                                for j in range(len(params))]) <= 1e-10
    engine.remove()


@pytest.mark.parametrize("tokens", [2, 16, 40])
def test_grouped_norms_of_a_linear_map_from_grams_from_unit_gradients_or_from_row_gradients(tokens):
    """Linear 64→64 (p·q = 4096), units of up to m = 3 rows of T tokens: T = 2, Grams of the units' m·T tokens; T = 16,
    each unit's gradient formed (m·T·(p+q) ≥ p·q > T·(p+q)); T = 40, rows' gradients formed in the backward."""
    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64).double()
    x = torch.randn(len(UNIT_OF_ROW), tokens, 64, dtype=torch.float64)
    engine = GhostClippingEngine(layer)
    with engine.recording(len(x)):
        layer(x).pow(2).sum().backward()
    _, groups = torch.unique(UNIT_OF_ROW, return_inverse=True)
    norms = engine.squared_norms(groups)
    assert (layer.weight in engine.explicit) == (tokens == 40)
    for p in (layer.weight, layer.bias):
        rows = [torch.autograd.grad(layer(x[i]).pow(2).sum(), p)[0] for i in range(len(x))]
        want = torch.stack([sum(g for g, u in zip(rows, groups) if u == unit).pow(2).sum() for unit in range(3)])
        assert relative([norms[p]], [want]) <= 1e-10


@pytest.mark.parametrize("kind, mode", [("gpt2", "flat"), ("gpt2", "per_layer"), ("vit", "automatic")])
def test_dp_optimizer_clips_whole_units_with_the_ghost_engine(kind, mode):
    """MicroBatchDPOptimizer(whole_units=True), as sharded runs make it: each unit clipped once by the clipping mode
    (float32 run against the float64 brute force)."""
    from hf_dp_repr.privacy.clipping_modes import clip_factors
    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine
    from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer

    model, inputs, labels = unit_case(kind, torch.float32)
    reference, ref_inputs, _ = unit_case(kind, torch.float64)
    params, per_unit = per_unit_gradients(reference, ref_inputs, labels)
    norms = torch.stack([torch.stack([g.norm() for g in grads]) for grads in per_unit])
    clip = norms.norm(dim=1).median().item()
    factors = clip_factors(mode, norms, clip)
    want = [sum(factors[u, j] * g[j] for u, g in enumerate(per_unit)) for j in range(len(params))]
    engine = GhostClippingEngine(model)
    optimizer = MicroBatchDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), clipping=mode, noise_multiplier=0.0,
                                      max_grad_norm=clip, expected_batch_size=1, noise_generator=lambda *a: None,
                                      ghost=engine, whole_units=True)
    with engine.recording(len(labels)):
        row_losses(model, inputs, labels).sum().backward()
    optimizer.accumulate_micro_batch(UNIT_OF_ROW)
    assert relative([optimizer._clipped_sums[p].double() for p in model.parameters()], want) <= 1e-5
    engine.remove()


def test_ghost_optimizer_refuses_units_it_could_cut():
    """Units with the ghost engine only for whole units (sharded runs); a unit met again in the step is refused."""
    from hf_dp_repr.errors import UnsupportedError
    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine
    from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer

    layer = torch.nn.Linear(3, 2)
    for whole, units, match in ((False, [[1, 1]], "whole units"), (True, [[1, 2], [2, 3]], "unit 2 appears again")):
        engine = GhostClippingEngine(layer)
        optimizer = MicroBatchDPOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0), clipping="flat",
                                          noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=1,
                                          noise_generator=lambda *a: None, ghost=engine, whole_units=whole)
        with pytest.raises(UnsupportedError, match=match):
            for ids in units:
                with engine.recording(2):
                    layer(torch.randn(2, 3)).sum().backward()
                optimizer.accumulate_micro_batch(torch.tensor(ids))
        engine.remove()
