"""Linear probing on cached head inputs: same updates as running the backbone, and used only when it may be."""

import pytest
import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.probe_batch import PROBE_ROWS
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit


def probe(dataset, tmp_path, model=None, **kw):
    kw = {"noise_multiplier": 0.0, "per_device_train_batch_size": 32, **kw}
    args = DPTrainingArguments(output_dir=str(tmp_path), trainable_blocks=0, max_steps=6, learning_rate=0.05,
                               report_to="none", save_strategy="no", disable_tqdm=True, seed=0, noise_seed=0, **kw)
    trainer = DPTrainer(model=model or tiny_vit(), args=args, train_dataset=dataset)
    trainer.train()
    return trainer


def test_cached_probe_gives_the_same_updates_as_the_uncached_one(digits, tmp_path):
    data = digits["train"].select(range(300))
    cached = probe(data, tmp_path / "cached", cache_features=True)
    plain = probe(data, tmp_path / "plain", cache_features=False)
    assert cached.features.cached_head == "classifier" and plain.features.cached_head is None
    assert not torch.equal(plain.model.classifier.weight, tiny_vit().classifier.weight)  # the probe did train
    for (name, a), b in zip(cached.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert cached.ledger.history == plain.ledger.history


def test_noisy_cached_probe_is_accounted_like_the_uncached_one(digits, tmp_path):
    data = digits["train"].select(range(300))
    cached = probe(data, tmp_path / "c", noise_multiplier=None, target_epsilon=1.0, target_delta=1e-4)
    plain = probe(data, tmp_path / "p", noise_multiplier=None, target_epsilon=1.0, target_delta=1e-4,
                  cache_features=False)
    assert cached.features.cached_head == "classifier"  # auto: tiny ViT has no dropout and digits no transform
    assert cached.epsilon() == plain.epsilon() <= 1.0


def test_probe_falls_back_without_cache_when_caching_would_change_the_updates(digits, tmp_path, token_dataset):
    logger = logging.get_logger("hf_dp_repr.trainer")
    with CaptureLogger(logger) as cl:  # GPT-2's lm_head is its input embedding: training it changes the features
        trainer = probe(token_dataset, tmp_path / "gpt2", model=tiny_gpt2(), per_device_train_batch_size=8)
    assert trainer.features.cached_head is None and "shares parameters with the backbone" in cl.out

    transformed = digits["train"].select(range(300)).with_transform(lambda b: b)
    with CaptureLogger(logger) as cl:
        trainer = probe(transformed, tmp_path / "aug")
    assert trainer.features.cached_head is None and "transform" in cl.out



def test_probe_with_dropout_runs_the_frozen_backbone_in_eval_mode_and_caches(digits, tmp_path):
    """A frozen backbone is not trained: its dropout would only make the features random (MiniLM's DP probe never
    cached for that reason). It runs in eval mode, cached or not, and the head keeps train mode."""
    data = digits["train"].select(range(300))
    cached = probe(data, tmp_path / "c", model=tiny_vit(attention_probs_dropout_prob=0.3))
    assert cached.features.cached_head == "classifier"
    modes = []
    model = tiny_vit(attention_probs_dropout_prob=0.3)
    model.vit.layers[0].attention.register_forward_pre_hook(lambda m, a: modes.append(("backbone", m.training)))
    model.classifier.register_forward_pre_hook(lambda m, a: modes.append(("head", m.training)))
    plain = probe(data, tmp_path / "p", model=model, cache_features=False)
    assert plain.features.cached_head is None
    assert ("backbone", True) not in modes and ("head", True) in modes  # eval-mode evaluation adds ("head", False)
    for (name, a), b in zip(cached.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # the same updates


def test_cache_features_true_refuses_a_head_it_cannot_cache(token_dataset, tmp_path):
    with pytest.raises(ValueError, match="cache_features=True, but the head shares parameters"):
        probe(token_dataset, tmp_path, model=tiny_gpt2(), per_device_train_batch_size=8, cache_features=True)


def test_probe_evaluates_and_sweeps_on_features_computed_once(digits, tmp_path):
    """The eval set's head inputs are computed once and the probe is evaluated on them (the same metrics as running
    the backbone); a later train() and a model_init trial with the same backbone reuse the training set's."""
    import math

    from hf_dp_repr.scope.feature_store import clear_feature_cache

    clear_feature_cache()
    data, held_out = digits["train"].select(range(96)), digits["test"].select(range(40))
    model = tiny_vit()
    calls = []
    model.vit.layers[0].register_forward_pre_hook(lambda m, a: calls.append(len(a[0])))
    trainer = probe(data, tmp_path / "a", model=model)
    first = trainer.evaluate(held_out)
    rows = len(data) + len(held_out) + PROBE_ROWS  # one feature pass over each set, and the start-of-training probe
    assert sum(calls) == rows
    assert trainer.evaluate(held_out)["eval_loss"] == first["eval_loss"] and sum(calls) == rows
    plain = DPTrainer(model=model, args=trainer.args, train_dataset=data)  # not trained: runs the whole model
    assert math.isclose(plain.evaluate(held_out)["eval_loss"], first["eval_loss"], rel_tol=1e-5)
    calls.clear()
    probe(data, tmp_path / "b", model=model)  # a second run on the same backbone and data
    assert sum(calls) == PROBE_ROWS  # its start-of-training probe only

    made = []

    def model_init(trial=None):
        made.append(tiny_vit())
        made[-1].vit.layers[0].register_forward_pre_hook(lambda m, a: calls.append(len(a[0])))
        return made[-1]

    args = DPTrainingArguments(output_dir=str(tmp_path / "init"), trainable_blocks=0, max_steps=2,
                               noise_multiplier=0.0, per_device_train_batch_size=32, report_to="none",
                               save_strategy="no", disable_tqdm=True, noise_seed=0)
    swept = DPTrainer(model_init=model_init, args=args, train_dataset=data)
    calls.clear()
    swept.train()
    swept.train()  # a second trial: a fresh model with the same frozen weights
    # features from the store: the backbones ran in the start-of-training probes only
    assert len(made) >= 2 and swept.features.cached_head == "classifier" and sum(calls) == 2 * PROBE_ROWS
    clear_feature_cache()
