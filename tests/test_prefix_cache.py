"""trainable_blocks=k on cached prefix states: the same updates as running the frozen blocks, the frozen blocks run
once per dataset and process, and the cache (features of private data) reaches no file and no push."""

import math
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.probe_batch import PROBE_FORWARDS
from hf_dp_repr.scope.feature_store import _FOLDERS, _STORE, clear_feature_cache
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_vit
from utils import make_token_classification_dataset, make_token_dataset

# 3-4 blocks, so that k = 1 and 2 leave a frozen prefix. GPT-2 is a causal LM on right-padded rows (padding mask,
# labels -100 on padding) with an untied lm_head: a head tied to wte trains the prefix (see the fallback test).
MODELS = {
    "vit": (lambda: tiny_vit(), "vit.layers", "digits"),
    "gpt2": (lambda: tiny_gpt2(n_layer=3, tie_word_embeddings=False), "transformer.h", "tokens"),
    "bert": (lambda: tiny_bert_classifier(num_hidden_layers=3), "bert.encoder.layer", "labelled_tokens"),
}
EVAL_BATCH = 16


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_feature_cache()
    yield
    clear_feature_cache()


def data_for(kind, digits, n=64):
    if kind == "digits":
        return digits["train"].select(range(n))
    return make_token_dataset(n=n) if kind == "tokens" else make_token_classification_dataset(n=n)


def make_trainer(model, dataset, tmp_path, eval_dataset=None, **kw):
    kw = {"noise_multiplier": 0.0, "max_steps": 4, "trainable_blocks": 1, "save_strategy": "no", **kw}
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, learning_rate=0.05,
                               per_device_eval_batch_size=EVAL_BATCH, report_to="none", disable_tqdm=True, seed=0,
                               noise_seed=0, **kw)
    return DPTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset)


def count_calls(module) -> list:
    calls = []
    module.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


def assert_same_updates(a, b, init):
    changed = 0
    for (name, pa), pb, p0 in zip(a.named_parameters(), b.parameters(), init.parameters()):
        step = (pb - p0).norm()
        changed += bool(step > 0)
        assert (pa - pb).norm() <= 1e-5 * step + 1e-12, name
    assert changed > 0  # the runs did train


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_cached_prefix_gives_the_same_updates_and_skips_the_frozen_blocks(name, k, digits, tmp_path):
    make, stack, kind = MODELS[name]
    data = data_for(kind, digits)
    cached_model = make()
    frozen_calls = count_calls(cached_model.get_submodule(stack)[0])
    cached = make_trainer(cached_model, data, tmp_path / "c", trainable_blocks=k, cache_features=True)
    cached.train()
    plain = make_trainer(make(), data, tmp_path / "p", trainable_blocks=k, cache_features=False)
    plain.train()
    assert cached.features.prefix_states is not None and plain.features.prefix_states is None
    assert_same_updates(cached.model, plain.model, make())
    # block 0 ran in the feature pass only (once per batch of the data) and the start-of-training probe (on a few
    # rows), never in a training step
    assert len(frozen_calls) == math.ceil(len(data) / EVAL_BATCH) + PROBE_FORWARDS
    assert cached.ledger.history == plain.ledger.history


def test_lp_then_ft_trains_both_phases_on_the_cached_states(digits, tmp_path):
    data = data_for("digits", digits)
    cached = make_trainer(tiny_vit(), data, tmp_path / "c", lp_steps=2, max_steps=5)
    plain = make_trainer(tiny_vit(), data, tmp_path / "p", lp_steps=2, max_steps=5, cache_features=False)
    cached.train()
    plain.train()
    assert cached.features.prefix_states is not None  # auto: no transform, no dropout problem, nothing below trains
    assert_same_updates(cached.model, plain.model, tiny_vit())


class ForgetBeforeTraining(TrainerCallback):
    def __init__(self, seen: dict):
        self.seen = seen

    def on_train_begin(self, args, state, control, **kwargs):
        for values in self.seen.values():
            values.clear()


def test_frozen_blocks_run_in_eval_mode_cached_or_not(digits, tmp_path):
    """Dropout in a frozen block would only make its output random (and uncacheable): frozen blocks and the
    embeddings run in eval mode on both paths, the trained block keeps its dropout, and the updates agree."""
    data = data_for("digits", digits)
    model = tiny_vit(attention_probs_dropout_prob=0.2)
    modes = {"frozen": set(), "trained": set()}
    model.vit.layers[0].register_forward_pre_hook(lambda m, a: modes["frozen"].add(m.training))
    model.vit.layers[3].register_forward_pre_hook(lambda m, a: modes["trained"].add(m.training))
    plain = make_trainer(model, data, tmp_path / "p", cache_features=False)
    plain.add_callback(ForgetBeforeTraining(modes))  # the start-of-training probe runs the model in eval mode
    plain.train()
    assert modes == {"frozen": {False}, "trained": {True}}
    cached = make_trainer(tiny_vit(attention_probs_dropout_prob=0.2), data, tmp_path / "c")
    cached.train()
    assert cached.features.prefix_states is not None
    assert_same_updates(cached.model, plain.model, tiny_vit(attention_probs_dropout_prob=0.2))


def test_feature_pass_is_paid_once_per_process_and_reused_for_evaluation(digits, tmp_path):
    data, held_out = data_for("digits", digits), digits["test"].select(range(32))
    model = tiny_vit()
    calls = count_calls(model.vit.layers[0])
    trainer = make_trainer(model, data, tmp_path / "a", eval_dataset=held_out, eval_strategy="steps", eval_steps=2)
    trainer.train()  # two evaluations
    # one feature pass over the training set, one over the eval set (and the start-of-training probe's forwards)
    passes = math.ceil(len(data) / EVAL_BATCH) + math.ceil(len(held_out) / EVAL_BATCH) + PROBE_FORWARDS
    assert len(calls) == passes
    cached_eval = trainer.evaluate()
    make_trainer(model, data, tmp_path / "a2").train()  # a second run of the same model on the same data
    passes += PROBE_FORWARDS  # its probe only
    assert len(calls) == passes
    fresh = tiny_vit()  # a sweep's next trial: a fresh model with the same frozen weights
    fresh_calls = count_calls(fresh.vit.layers[0])
    make_trainer(fresh, data, tmp_path / "b").train()
    assert len(fresh_calls) == PROBE_FORWARDS
    # evaluation on the cached states gives what running the whole model gives
    plain = make_trainer(tiny_vit(), data, tmp_path / "c", cache_features=False)
    plain.model.load_state_dict(trainer.model.state_dict())
    cached_eval = trainer.evaluate()
    plain_eval = plain.evaluate(held_out)
    assert plain.features.prefix_states is None and len(calls) == passes
    assert math.isclose(cached_eval["eval_loss"], plain_eval["eval_loss"], rel_tol=1e-5)


def pad_to_longest(rows):
    length = max(len(r["input_ids"]) for r in rows)
    pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.stack([torch.cat([torch.as_tensor(r[k]), torch.full((length - len(r[k]),), v)]) for r in rows])
            for k, v in pad.items()}


def test_falls_back_with_the_reason_logged(digits, tmp_path):
    logger = logging.get_logger("hf_dp_repr.trainer")
    cases = [  # GPT-2's lm_head is its input embedding: training it changes the prefix
        (tiny_gpt2(n_layer=3), make_token_dataset(n=32), {}, "parameters below block 2 train (transformer.wte"),
        (tiny_vit(), data_for("digits", digits).with_transform(lambda b: b), {}, "transform"),
        (tiny_vit(), data_for("digits", digits), {"cache_features_max_memory_gb": 1e-6}, "over cache_features_max"),
    ]
    ragged = make_token_dataset(n=32).map(lambda row: {k: v[:int(row["attention_mask"].sum())] for k, v in row.items()})
    cases.append((tiny_gpt2(n_layer=3, tie_word_embeddings=False), ragged, {}, "pads each batch to its longest row"))
    for model, data, kw, reason in cases:
        with CaptureLogger(logger) as cl:
            trainer = make_trainer(model, data, tmp_path, **kw)
            if data is ragged:
                trainer.data_collator = pad_to_longest
            trainer.train()
        assert trainer.features.prefix_states is None and reason in cl.out and "not cached" in cl.out, reason
    with pytest.raises(ValueError, match="cache_features=True, but parameters below block 2 train"):
        make_trainer(tiny_gpt2(n_layer=3), make_token_dataset(n=32), tmp_path, cache_features=True).train()
    with pytest.raises(ValueError, match="cache_features=True with trainable_blocks=None"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, cache_features=True, report_to="none")


def test_states_over_the_memory_bound_go_to_a_temporary_folder_never_the_output_dir(digits, tmp_path):
    data = data_for("digits", digits)
    out = tmp_path / "out"
    cached = make_trainer(tiny_vit(), data, out, cache_features_max_memory_gb=1e-6, cache_features_max_disk_gb=1)
    cached.train()
    (folder,) = _FOLDERS
    assert cached.features.prefix_states.folder == folder and not Path(folder).is_relative_to(out)
    plain = make_trainer(tiny_vit(), data, tmp_path / "p", cache_features=False)
    plain.train()
    assert_same_updates(cached.model, plain.model, tiny_vit())
    clear_feature_cache()
    assert not Path(folder).exists() and not _FOLDERS


def test_cached_states_reach_no_file_of_output_dir_and_no_push(digits, tmp_path, hub):
    """Every file the run writes (checkpoints, final save, metrics) and every pushed byte is searched for the
    cached states of the first training example."""
    out = tmp_path / "out"
    trainer = make_trainer(tiny_vit(), data_for("digits", digits), out, save_strategy="steps", save_steps=2,
                           push_to_hub=True, hub_model_id="someone/prefix", hub_always_push=True)
    result = trainer.train()
    trainer.save_model()
    trainer.save_metrics("all", result.metrics)
    trainer.push_to_hub()
    states = _STORE[next(iter(_STORE))].states
    needle = states[0].flatten()[:16].numpy().tobytes()  # 64 bytes of private features
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in written) and any("checkpoint-" in str(p) for p in written)
    assert not [p for p in written if needle in p.read_bytes()]
    pushed = [(c.title, name, data) for c in hub.repos["someone/prefix"].commits[1:] for name, data in c.files.items()]
    assert pushed and not [(title, name) for title, name, data in pushed if needle in data]
