"""A user's first own run (issue 40.2, 40.3): nothing private is used without DP unless the user says so, the result
table says what was trained with DP, and the DP-aware defaults (hf_dp_repr.scripts.dp_defaults)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.scripts import report as recipe_report
from hf_dp_repr.training.plan import plan_run


def _npz(path, n=40):
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8), y_train=np.arange(n) % 2,
             x_test=rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8), y_test=np.arange(6) % 2,
             class_names=np.array(["a", "b"]))
    return str(path)


def test_a_random_init_model_on_your_own_data_is_refused_in_one_line(tmp_path, capsys):
    """The default tiny ViT (random init) on the user's images took half of them as public data, trained on without
    DP; now refused before any work, naming the three fixes; with --public_fraction it runs as asked."""
    from hf_dp_repr.cli import main

    out = tmp_path / "out"
    code = main(["train", "image", "--dataset_name", _npz(tmp_path / "mine.npz"), "--output_dir", str(out),
                 "--target_epsilon", "8", "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert all(f in err for f in ("--model_name_or_path", "public dataset", "--public_fraction")), err
    assert not out.exists()


def test_the_result_table_says_what_was_trained_with_dp_and_what_without():
    args = DPTrainingArguments(output_dir="/tmp/t", target_epsilon=8, target_delta=1e-4, max_steps=3,
                               per_device_train_batch_size=16, report_to="none")
    ledger = SimpleNamespace(plan=plan_run(args, 160), steps_done=3)
    table = recipe_report.result_table({"eval_accuracy": 0.5, "epsilon": 7.9}, ledger, "test", public_fraction=0.5)
    assert "| examples trained with DP" in table and "160 (the 50% of the training split not used as public" in table
    assert "50% of the training split, trained on WITHOUT DP" in table
    assert "public" not in recipe_report.result_table({"epsilon": 7.9}, ledger, "test")  # no public data: no row


def test_the_image_recipe_still_refuses_before_reading_the_data(tmp_path):
    with pytest.raises(RecipeArgumentError, match="randomly initialised"):
        image_recipe.main(["--dataset_name", str(tmp_path / "none.npz"), "--output_dir", str(tmp_path / "o"),
                           "--target_epsilon", "8", "--report_to", "none"])
