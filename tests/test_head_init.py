"""`head_init="zeros"`: exactly the head's output layer starts at zero, with `model=`, with `model_init`, and for each
trial of a hyperparameter search (whose arguments are set after the Trainer made the model); refused where zeroing
would be wrong (tied weights, no head)."""

import csv
import os

import optuna
import pytest
import torch
from transformers import GPT2LMHeadModel, RobertaConfig, RobertaForSequenceClassification, TrainerCallback, ViTModel

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.scope.head_init import init_head, output_layer
from hf_dp_repr.tiny import tiny_gpt2_config, tiny_vit, tiny_vit_config


def dp_args(tmp_path, **kw):
    kw = {"target_epsilon": 4.0, "target_delta": 1e-4, "accountant": "rdp", "max_steps": 1,
          "per_device_train_batch_size": 16, **kw}
    return DPTrainingArguments(output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True,
                               logging_strategy="no", eval_strategy="no", **kw)


def test_unknown_value_is_refused(tmp_path):
    with pytest.raises(DPConfigError, match="head_init"):
        dp_args(tmp_path, head_init="xavier")


def test_zeros_sets_only_the_classifier_to_zero_then_training_moves_it(digits, tmp_path):
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, head_init="zeros"), train_dataset=digits["train"])
    for name, value in model.state_dict().items():
        if name.startswith("classifier."):
            assert not value.any(), name
        else:
            assert torch.equal(value, before[name]), name
    trainer.train()
    assert model.classifier.weight.any()  # one noisy DP step moved it off zero


def test_default_leaves_the_model_alone(digits, tmp_path):
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    DPTrainer(model=model, args=dp_args(tmp_path), train_dataset=digits["train"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.classifier.weight.any()


def test_two_layer_head_zeroes_the_output_layer_only():
    # RoBERTa's head is dense → tanh → out_proj: zeroing dense too would leave both layers with zero gradients.
    torch.manual_seed(0)
    model = RobertaForSequenceClassification(RobertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=32, num_labels=3))
    assert init_head(model, "zeros") == "classifier.out_proj"
    assert not model.classifier.out_proj.weight.any() and not model.classifier.out_proj.bias.any()
    assert model.classifier.dense.weight.any()


def test_tied_output_layer_and_missing_head_are_refused():
    with pytest.raises(DPConfigError, match="tied"):
        init_head(GPT2LMHeadModel(tiny_gpt2_config()), "zeros")
    with pytest.raises(DPConfigError, match="no head"):
        output_layer(ViTModel(tiny_vit_config()))
    init_head(ViTModel(tiny_vit_config()), "default")  # nothing to do, nothing refused


class HeadAtStart(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.seen.append((args.head_init, float(model.classifier.weight.detach().abs().sum())))


def test_each_search_trial_starts_from_its_own_head_init(digits, tmp_path):
    # The baseline says "zeros"; a trial that draws "default" must start from the model's own (non-zero) head, and
    # one that draws "zeros" from zero, although the Trainer makes the model before it sets the trial's arguments.
    # What model_init(trial) draws reaches the trials CSV too.
    def model_init(trial):
        if trial is not None:
            trial.suggest_categorical("probe_variant", ["a"])
        return tiny_vit()

    callback = HeadAtStart()
    trainer = DPTrainer(model_init=model_init, args=dp_args(tmp_path, head_init="zeros"),
                        train_dataset=digits["train"].select(range(64)), eval_dataset=digits["test"].select(range(32)),
                        callbacks=[callback])
    grid = optuna.samplers.GridSampler({"head_init": ["default", "zeros"], "probe_variant": ["a"]})
    trainer.hyperparameter_search(hp_space=lambda t: {"head_init": t.suggest_categorical("head_init",
                                                                                         ["default", "zeros"])},
                                  n_trials=2, tuning_data="held_out", sampler=grid)
    assert sorted(h for h, _ in callback.seen) == ["default", "zeros"]
    for head_init, norm in callback.seen:
        assert (norm == 0) == (head_init == "zeros"), callback.seen
    with open(os.path.join(tmp_path, "hp_search_trials.csv")) as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["head_init"] for r in rows) == ["default", "zeros"]
    assert [r["probe_variant"] for r in rows] == ["a", "a"]
    assert trainer.args.head_init == "zeros"  # the baseline is back after the search
