"""An evaluation set that shares rows with the training set: warned, its metrics named `train_eval_*` and kept out
of metrics files, the model card and pushes; choosing the released checkpoint by them is refused."""

import json
import logging

import pytest

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.hub import check_pushable
from hf_dp_repr.hub.card import write_model_card
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.eval_overlap import shared_rows


def _args(tmp_path, **kw):
    return DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-3, max_steps=1,
                               per_device_train_batch_size=32, accountant="rdp", report_to="none",
                               disable_tqdm=True, **{"save_strategy": "no", **kw})


def test_training_rows_under_a_new_fingerprint_are_found(digits):
    train = digits["train"].select(range(200))
    assert shared_rows(train, train) == ("it is the training set", True)
    assert shared_rows(train, train.select(range(50)).flatten_indices()) == (
        "all 50 rows checked are training rows", True)
    mixed = digits["train"].select(range(190, 230))  # 10 training rows, 30 others: drawn from the training data
    assert shared_rows(train, mixed) == ("10 of 40 distinct rows checked are training rows", True)
    few = digits["train"].select(range(199, 239))  # 1 of 40: a duplicate across splits, metrics kept (warned)
    assert shared_rows(train, few) == ("1 of 40 distinct rows checked are training rows", False)
    assert shared_rows(train, digits["test"]) is None


def test_metrics_on_training_rows_are_warned_and_stay_out_of_files_card_and_push(digits, tmp_path, caplog):
    train = digits["train"].select(range(128))
    with caplog.at_level(logging.WARNING):
        trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=train,
                            eval_dataset=train.shuffle(seed=0))
    assert "overlaps the training set (all 128 rows checked are training rows)" in caplog.text
    trainer.train()
    metrics = trainer.evaluate()
    assert "train_eval_loss" in metrics and not [k for k in metrics if k.startswith("eval_")]
    held_out = trainer.evaluate(digits["test"].select(range(64)))  # held-out rows keep their usual names
    assert "eval_loss" in held_out
    trainer.save_metrics("all", {**metrics, "epsilon": trainer.epsilon()})
    trainer.save_model()
    saved = json.loads((tmp_path / "all_results.json").read_text())
    assert "epsilon" in saved and not [k for k in saved if "eval" in k]
    check_pushable(tmp_path)  # nothing private in the files a push sends
    card = write_model_card(trainer, tmp_path).content
    assert "eval_loss" not in card and str(round(metrics["train_eval_loss"], 4)) not in card


def test_choosing_the_checkpoint_by_training_rows_is_refused_before_any_work(digits, tmp_path):
    train = digits["train"].select(range(128))
    args = _args(tmp_path, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True)
    with pytest.raises(DPConfigError, match="load_best_model_at_end=True.*held-out rows"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=train, eval_dataset=train.select(range(64)))
    assert not list(tmp_path.iterdir())
    # On a dict of eval sets only the metric that picks the checkpoint matters.
    args = _args(tmp_path, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True,
                 metric_for_best_model="eval_held_out_loss")
    DPTrainer(model=tiny_vit(), args=args, train_dataset=train,
              eval_dataset={"held_out": digits["test"].select(range(64)), "seen": train})
