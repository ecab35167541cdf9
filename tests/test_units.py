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
    with pytest.warns(UserWarning, match=r"n=6 training units"):
        DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=user_dataset(digits))
