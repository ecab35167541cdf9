"""The LP→FT budget curve (tuning/budget_split.py): every run spends its target ε, the composed cost is stated and
the outputs are written."""

import csv
import os

import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.tuning.budget_split import sweep_budget_split, write_budget_split


@pytest.mark.slow  # the docstring example of budget_split runs a smaller sweep in the fast suite
def test_budget_split_sweep_spends_the_target_per_run_and_states_the_composed_cost(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=2.0, target_delta=1e-4, max_steps=4,
                               per_device_train_batch_size=64, trainable_blocks=1, report_to="none",
                               save_strategy="no", logging_strategy="no", disable_tqdm=True, accountant="rdp")
    result = sweep_budget_split(tiny_vit, args, digits["train"].select(range(256)), digits["test"].select(range(64)),
                                fractions=[0.2, 0.8], lp_steps=[0.5], progress=False)
    assert [r["lp_epsilon_fraction"] for r in result.rows] == [None, 0.2, 0.8]
    for r in result.rows:
        assert r["epsilon"] == pytest.approx(2.0, rel=0.01)
    # the LP phase alone spends about its share (its σ is calibrated for fraction·ε)
    assert result.rows[1]["epsilon_linear_probe"] == pytest.approx(0.4, rel=0.01)
    assert result.best["accuracy"] == max(r["accuracy"] for r in result.rows)
    assert result.composed_epsilon > 2.0  # choosing among 3 runs on private data costs more than one run
    csv_path, png_path = write_budget_split(result, str(tmp_path))
    with open(csv_path) as f:
        assert len(list(csv.DictReader(f))) == 3
    assert os.path.getsize(png_path) > 0
    assert "best split" in result.summary()
