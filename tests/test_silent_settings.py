"""Settings the Trainer accepts that DP-SGD used to ignore without a word: label smoothing is applied per
example, fp16 is refused (its loss scale would be clipped), and q = 1 (full batch) is accounted for exactly."""

import json
import math
import warnings

import pytest
import torch
from datasets import Dataset
from scipy.optimize import brentq
from scipy.stats import norm
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


def test_fp16_is_refused_and_points_to_bf16(tmp_path):
    with pytest.raises(ValueError, match=r"fp16=True.*GradScaler.*bf16=True"):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=8.0, fp16=True, report_to="none")
    assert not (tmp_path / "never").exists()


def gaussian_epsilon(sigma, steps, delta):
    """Exact ε of `steps` full-batch Gaussian steps (μ-GDP with μ = √steps/σ; Dong, Roth & Su)."""
    mu = math.sqrt(steps) / sigma
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 100)


def test_a_one_example_dataset_is_full_batch_dp_sgd_without_warnings(tmp_path):
    data = Dataset.from_dict({"pixel_values": torch.rand(1, 1, 8, 8).numpy(), "labels": [3]}).with_format("torch")
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-5, max_steps=3,
                               per_device_train_batch_size=1, learning_rate=1e-2, save_strategy="no",
                               report_to="none", disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # was: divide by zero in the PRV accountant
        trainer.train()
    phase = trainer.ledger.plan.phases[0]
    assert phase.sample_rate == 1.0 and trainer.ledger.steps_done == 3
    # No amplification by sampling at q = 1; replace-one (the default) moves the sum by up to 2C: σ/2 for add/remove.
    assert trainer.ledger.plan.neighboring == "replace_one"
    exact = gaussian_epsilon(phase.noise_multiplier / 2, 3, 1e-5)
    assert exact <= trainer.epsilon() <= 8.0 and trainer.epsilon() == pytest.approx(exact, rel=0.01)


def test_privacy_cli_accounts_for_a_full_batch(capsys):
    from hf_dp_repr.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["privacy", "--sample-rate", "1", "--noise-multiplier", "2", "--steps", "10", "--delta",
                     "1e-5"]) == 0
    out = json.loads(capsys.readouterr().out)
    eps = out["epsilon"]
    assert out["neighboring"] == "replace_one"  # the default: sensitivity 2C, the add/remove ε at σ/2
    exact = gaussian_epsilon(1.0, 10, 1e-5)
    assert exact <= eps <= 1.01 * exact
