"""What DP-SGD cannot train privately is refused before anything is trained or written, naming the argument or
module and the fix (privacy/validation.py; DPTrainer's init): a dataset without a length, BatchNorm, ViT embedding
dropout, a batch loss (compute_loss_func), packed rows, δ ≥ 1/n (unless allow_large_delta=True: then warned, and
stated on the card)."""

import copy

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import DataCollatorWithFlattening

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError, NotPrivatizableError
from hf_dp_repr.privacy.validation import check_one_row_per_example
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import dp_args


def _args(out):
    return DPTrainingArguments(output_dir=str(out), target_epsilon=1.0, target_delta=1e-5, report_to="none")


def test_iterable_dataset_is_refused(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter([{"pixel_values": torch.zeros(1, 8, 8), "labels": 0}]))
    with pytest.raises(ValueError, match="must have a length"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), train_dataset=stream)
    assert not (tmp_path / "never").exists()


def test_dataset_without_length_is_refused(tmp_path):
    class NoLength(torch.utils.data.Dataset):
        def __getitem__(self, i):
            return {"labels": 0}

    with pytest.raises(ValueError, match="must have a length"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), train_dataset=NoLength())


def test_delta_above_one_over_n_is_refused_naming_n_the_bound_and_the_fix(tmp_path):
    small = Dataset.from_dict({"pixel_values": torch.zeros(50, 1, 8, 8).numpy(), "labels": [0] * 50})
    args = DPTrainingArguments(output_dir=str(tmp_path / "o"), target_epsilon=1.0, target_delta=0.02, report_to="none")
    with pytest.raises(DPConfigError, match=r"target_delta=0.02 is >= 1/n = 0.02 for n=50 training examples.*"
                                            r"target_delta=2.0e-03, or set allow_large_delta=True"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=small)
    assert not (tmp_path / "o").exists()
    args.allow_large_delta = True
    with pytest.warns(UserWarning, match=r"n=50 .*Allowed by allow_large_delta=True"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=small)


def test_card_says_in_plain_words_when_delta_was_allowed_above_one_over_n():
    from hf_dp_repr.hub.card import render_model_card
    from hf_dp_repr.privacy.accounting import compute_epsilon

    def card(delta):
        led = dict(accountant="pld", target_delta=delta, per_sample_max_grad_norm=1.0, clipping="flat",
                   dataset_size=719, target_epsilon=4.0, neighboring="replace_one", history=[[1.0, 0.1, 20]],
                   phases=[dict(name="train", noise_multiplier=1.0, sample_rate=0.1, steps=20, expected_batch_size=72)],
                   steps_done=20, planned_steps=20)
        led["epsilon"] = compute_epsilon([(1.0, 0.1, 20)], delta, "pld", "replace_one")
        return render_model_card(led, scope="all").text

    weak = card(0.01)
    assert "**Weak δ:** δ = 0.01 is at least 1/n = 1/719" in weak and "allow_large_delta=True" in weak
    assert "Weak δ" not in card(1e-4)


def test_batchnorm_is_refused_with_its_path(tmp_path):
    model = tiny_vit()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    with pytest.raises(NotPrivatizableError, match=r"classifier\.0 \(BatchNorm1d\).*ModuleValidator\.fix"):
        DPTrainer(model=model, args=_args(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_vit_embedding_dropout_is_refused(tmp_path):
    with pytest.raises(NotPrivatizableError, match="hidden_dropout_prob=0"):
        DPTrainer(model=tiny_vit(hidden_dropout_prob=0.1), args=_args(tmp_path / "never"))


def test_compute_loss_func_is_refused(tmp_path):
    with pytest.raises(ValueError, match="per_example_loss"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), compute_loss_func=lambda *a, **k: 0)


# ---- packed rows --------------------------------------------------------------------------------------
def test_packed_batches_are_refused_before_training(token_dataset, tmp_path):
    model = tiny_gpt2()
    before = copy.deepcopy(model.state_dict())
    rows = token_dataset.with_format(None).map(lambda r: {"input_ids": r["input_ids"][: sum(r["attention_mask"])]},
                                               remove_columns=["attention_mask", "labels"])
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, per_device_train_batch_size=4, max_steps=2),
                        train_dataset=rows, data_collator=DataCollatorWithFlattening())
    with pytest.raises(ValueError, match="no packing under DP-SGD"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert trainer.ledger is None  # no step was accounted, none was taken


def test_one_row_per_example_check():
    ids = torch.arange(12).view(2, 6)
    check_one_row_per_example({"input_ids": ids, "labels": ids}, 2)
    left_padded = {"position_ids": torch.tensor([[1, 1, 0, 1, 2, 3]]),
                   "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1]])}
    check_one_row_per_example(left_padded, 1)
    with pytest.raises(ValueError, match="`input_ids` has shape \\(1, 12\\) for 2 examples"):
        check_one_row_per_example({"input_ids": ids.view(1, 12)}, 2)
    with pytest.raises(ValueError, match="`position_ids` restart inside a row"):
        check_one_row_per_example({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}, 1)


# ---- a compute_loss override ---------------------------------------------------------------------------
def test_a_compute_loss_override_is_refused_naming_per_example_loss(tmp_path):
    """It was called 0 times in training: the run trained on the per-example loss without a word."""
    from transformers import Trainer

    class Weighted(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ValueError, match=r"Weighted overrides `compute_loss`.*override `per_example_loss`"):
        Weighted(model=tiny_vit(), args=_args(tmp_path / "never"))

    class EvalOnly(Weighted):  # declared in the class that defines it: accepted
        compute_loss = Weighted.compute_loss
        compute_loss_handled = True

    EvalOnly(model=tiny_vit(), args=_args(tmp_path / "never"))

    class Again(EvalOnly):  # the declaration does not cover a further override
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    with pytest.raises(ValueError, match="Again overrides `compute_loss`"):
        Again(model=tiny_vit(), args=_args(tmp_path / "never"))

    class TRLLike(Trainer):  # a library trainer's compute_loss, after DPTrainer in the MRO (DPSFTTrainer's shape)
        def compute_loss(self, *args, **kwargs):
            raise AssertionError("never called")

    class DPTRLLike(DPTrainer, TRLLike):
        pass

    DPTRLLike(model=tiny_vit(), args=_args(tmp_path / "never"))
