"""The LP→FT budget curve and the seed-000 sweep: every run spends its target ε, the outputs are written."""

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


@pytest.mark.slow
def test_seed000_sweep_writes_its_report(tmp_path):
    from hf_dp_repr.scripts.seed000 import run_seed000

    space = lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-2, log=True),  # noqa: E731
                       "num_train_epochs": t.suggest_categorical("num_train_epochs", [1])}
    summary = run_seed000(str(tmp_path), epsilons=(1.0,), ks=(1, 4), n_trials=2, pretrain_epochs=3,
                          constant_epochs=1, hp_space=space, progress=False)
    assert [(r["k"], r["run"]) for r in summary["rows"]] == [(1, "tuned"), (1, "constant_lr"), (4, "tuned"),
                                                             (4, "constant_lr")]
    for r in summary["rows"]:
        assert r["epsilon_spent"] == pytest.approx(1.0, rel=0.01)
        assert len(r["fuzziness"].split(",")) == 5  # D_l at the embedding output and after each of the 4 blocks
    for name in ("report.md", "results.csv", "summary.json", "accuracy_vs_k.png", "fuzziness_by_layer.png"):
        assert os.path.exists(tmp_path / name)
