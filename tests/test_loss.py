"""Per-example losses (privacy/loss.py): label smoothing, which DP-SGD used to ignore without a word, is applied per
example as the Trainer's smoother computes it, and refused for float labels."""


import pytest
import torch
from transformers.trainer_pt_utils import LabelSmoother
from transformers.utils import ModelOutput

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.loss import per_example_loss
from hf_dp_repr.tiny import tiny_vit

EPS = 0.1


def smoothed_nll(logits_row, label):
    """(1 - ε)·(-log p_label) + ε·mean_k(-log p_k), written out for one prediction."""
    neg_log_p = -torch.log_softmax(logits_row.double(), -1)
    return (1 - EPS) * neg_log_p[label] + EPS * neg_log_p.mean()


def test_label_smoothing_for_class_labels_matches_a_hand_computation():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5), torch.tensor([0, 4, 2])
    hand = torch.stack([smoothed_nll(logits[i], labels[i]) for i in range(3)]).float()
    torch.testing.assert_close(per_example_loss(logits, labels, label_smoothing=EPS), hand)
    assert not torch.allclose(per_example_loss(logits, labels), hand)  # smoothing changes the loss


def test_label_smoothing_for_token_labels_ignores_padding_and_matches_the_trainers_smoother():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, -100, 6, 0]])
    hand = []
    for i in range(2):  # causal LM: position t predicts label t + 1
        terms = [smoothed_nll(logits[i, t], labels[i, t + 1]) for t in range(4) if labels[i, t + 1] != -100]
        hand.append(torch.stack(terms).mean())
    losses = per_example_loss(logits, labels, shift_labels=True, label_smoothing=EPS)
    torch.testing.assert_close(losses, torch.stack(hand).float())
    smoother = LabelSmoother(epsilon=EPS)  # what the Trainer computes on a batch of one example
    for i in range(2):
        reference = smoother({"logits": logits[i:i + 1]}, labels[i:i + 1], shift_labels=True)
        torch.testing.assert_close(losses[i], reference)


def test_dp_trainer_applies_label_smoothing_factor_and_refuses_it_for_float_labels(tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, label_smoothing_factor=EPS,
                               report_to="none")
    trainer = DPTrainer(model=tiny_vit(), args=args)
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 10), torch.tensor([1, 3, 5, 7])
    hand = torch.stack([smoothed_nll(logits[i], labels[i]) for i in range(4)]).float()
    torch.testing.assert_close(trainer.per_example_loss(ModelOutput(logits=logits), labels), hand)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 applies to class labels"):
        per_example_loss(torch.randn(4, 1), torch.randn(4), label_smoothing=EPS)
