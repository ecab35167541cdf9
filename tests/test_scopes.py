"""Fine-tuning scopes under DP: last k blocks, linear probe, LP→FFT; what trains and what stays bit-identical."""

import pytest
import torch
from transformers import TrainerCallback
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import ScopeError
from hf_dp_repr.scope import find_block_stack, select_scope
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama, tiny_vit
from utils import StopAt, make_token_classification_dataset, make_token_dataset

# For each model: its constructor, its data, and by hand (not from the code under test) which parameter-name
# prefixes form the blocks, what follows the blocks, the head, and the embeddings.
MODELS = {
    "vit": (tiny_vit, "digits", "vit.layers.{}.", ["vit.layernorm."], ["classifier."], 4),
    "gpt2": (tiny_gpt2, "tokens", "transformer.h.{}.", ["transformer.ln_f."], ["transformer.wte."], 2),  # tied head
    "bert": (tiny_bert_classifier, "labelled_tokens", "bert.encoder.layer.{}.", ["bert.pooler."], ["classifier."], 2),
    "llama": (tiny_llama, "tokens", "model.layers.{}.", ["model.norm."], ["lm_head."], 2),
}


def dataset_for(kind, digits):
    if kind == "digits":
        return digits["train"].select(range(128))
    if kind == "tokens":
        return make_token_dataset(n=64)
    return make_token_classification_dataset(n=64)


def expected_prefixes(name, scope):
    _, _, block, after, head, depth = MODELS[name]
    if scope == "linear_probe":
        return head
    k = {"k=1": 1, "k=L": depth, "lp_then_k=1": 1}[scope]
    return [block.format(i) for i in range(depth - k, depth)] + after + head


def train(model, dataset, tmp_path, **kw):
    kw = {"noise_multiplier": 1.0, "max_steps": 4, **kw}
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, learning_rate=1e-2,
                               report_to="none", save_strategy="no", disable_tqdm=True, seed=0, noise_seed=0, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return trainer


SCOPES = {"k=1": dict(trainable_blocks=1), "k=L": dict(trainable_blocks="L"), "linear_probe": dict(trainable_blocks=0),
          "lp_then_k=1": dict(trainable_blocks=1, lp_steps=2)}


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_scope_trains_exactly_its_parameters(name, scope, digits, tmp_path):
    make, data, *_, depth = MODELS[name]
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = {k: (depth if v == "L" else v) for k, v in SCOPES[scope].items()}
    train(model, dataset_for(data, digits), tmp_path, **kw)
    prefixes = expected_prefixes(name, scope)
    for n, p in model.named_parameters():
        if n.startswith(tuple(prefixes)):
            assert not torch.equal(p, before[n]), f"{n} is in the {scope} scope but did not change"
        else:
            assert torch.equal(p, before[n]), f"{n} is outside the {scope} scope but changed"


def test_embeddings_train_only_under_full_fine_tuning(digits, tmp_path):
    model = tiny_vit()
    before = model.vit.embeddings.cls_token.detach().clone()
    train(model, digits["train"].select(range(128)), tmp_path, trainable_blocks=None)
    assert not torch.equal(model.vit.embeddings.cls_token, before)


def test_block_stack_is_found_by_structure_and_can_be_overridden():
    assert find_block_stack(tiny_gpt2())[0] == "transformer.h"
    assert find_block_stack(tiny_bert_classifier())[0] == "bert.encoder.layer"
    assert find_block_stack(tiny_llama())[0] == "model.layers"
    assert find_block_stack(tiny_vit(), block_stack="vit.layers")[0] == "vit.layers"
    with pytest.raises(ScopeError, match="block_stack='vit.nope'.*no such submodule"):
        find_block_stack(tiny_vit(), block_stack="vit.nope")
    with pytest.raises(ScopeError, match="not a non-empty ModuleList"):
        find_block_stack(tiny_vit(), block_stack="vit.layernorm")
    with pytest.raises(ScopeError, match="no stack of transformer blocks found.*block_stack="):
        find_block_stack(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_bad_trainable_blocks_name_the_fix(digits, tmp_path):
    with pytest.raises(ScopeError,
                       match="trainable_blocks=5, but ViTForImageClassification has 4 blocks in vit.layers"):
        select_scope(tiny_vit(), 5)
    with pytest.raises(ValueError, match="trainable_blocks=-1 must be >= 0"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_blocks=-1)
    with pytest.raises(ScopeError, match="has 4 blocks"):
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_blocks=9,
                                   report_to="none")
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    with pytest.raises(ValueError, match="lp_steps with trainable_blocks=0"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_blocks=0, lp_steps=2)
    with pytest.raises(ValueError, match="clipping='per_layer'"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, lp_steps=2, clipping="per_layer")
    with pytest.raises(ValueError, match="lp_learning_rate set but lp_steps=0"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, lp_learning_rate=0.1)


def test_start_of_training_logs_the_trainable_table(digits, tmp_path):
    logger = logging.get_logger("hf_dp_repr.trainer")
    with CaptureLogger(logger) as cl:
        # The plan is an INFO line: shown with log_level="info", as the README says (whatever earlier tests set).
        train(tiny_vit(), digits["train"].select(range(128)), tmp_path, trainable_blocks=1, max_steps=1,
              log_level="info")
    block = sum(p.numel() for p in tiny_vit().vit.layers[3].parameters())
    assert "vit.layers.3" in cl.out and f"{block:,}" in cl.out
    assert "trainable            34,250  of 136,138" in cl.out  # block 3 + final layernorm (128) + head (650)
    assert "noise per parameter per step: std σ·C/B = 0.0625" in cl.out  # σ=1, C=1, B=16
    # at the end: ε and what it means for a membership attacker (PrivacyLedger.summary)
    assert "DPTrainer: 1 of 1 DP steps taken: (ε = " in cl.out and "a membership test can reach at most TPR" in cl.out


class _Snapshot(TrainerCallback):
    """Copies the head and one backbone weight at the end of the linear-probing phase."""

    def __init__(self, model, at_step):
        self.model, self.at_step, self.taken = model, at_step, None

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at_step:
            self.taken = (self.model.classifier.weight.detach().clone(),
                          self.model.vit.layers[3].mlp.fc1.weight.detach().clone())


@pytest.mark.parametrize("fraction", [None, 0.3])
def test_lp_then_ft_spends_exactly_the_target_and_continues_from_the_probe(fraction, digits, tmp_path):
    model = tiny_vit()
    head0, block0 = model.classifier.weight.detach().clone(), model.vit.layers[3].mlp.fc1.weight.detach().clone()
    snap = _Snapshot(model, at_step=3)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), target_epsilon=2.0, target_delta=1e-4, max_steps=8, trainable_blocks=1,
        lp_steps=3, lp_epsilon_fraction=fraction, lp_per_device_train_batch_size=32, lp_learning_rate=0.05,
        per_device_train_batch_size=16, learning_rate=1e-2, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1)
    trainer = DPTrainer(model=model, args=args, train_dataset=digits["train"].select(range(400)), callbacks=[snap])
    trainer.train()
    ledger = trainer.ledger
    assert [p.name for p in ledger.plan.phases] == ["linear_probe", "fine_tune"]
    assert [p.steps for p in ledger.plan.phases] == [3, 5]
    assert [p.expected_batch_size for p in ledger.plan.phases] == [32, 16]
    assert 0.99 * 2.0 <= trainer.epsilon() <= 2.0
    by_phase = ledger.epsilon_by_phase()
    if fraction is not None:
        assert by_phase["linear_probe"] == pytest.approx(0.3 * 2.0, rel=0.01)
    else:
        assert ledger.plan.phases[0].noise_multiplier == ledger.plan.phases[1].noise_multiplier
    logged = [h for h in trainer.state.log_history if "epsilon_fine_tune" in h]
    assert logged and logged[-1]["epsilon_linear_probe"] == pytest.approx(by_phase["linear_probe"])
    head1, block1 = snap.taken
    assert not torch.equal(head1, head0) and torch.equal(block1, block0)  # phase 1: the head alone trained
    assert not torch.equal(model.vit.layers[3].mlp.fc1.weight, block0)  # phase 2 trained the block
    # Phase 2 starts from the phase-1 head (not a fresh one): the head moved by a few small steps from head1.
    assert (model.classifier.weight - head1).norm() < (head1 - head0).norm() + (model.classifier.weight - head0).norm()
    assert trainer.state.log_history[0]["learning_rate"] == pytest.approx(0.05)


_StopAt = StopAt


def test_resume_across_the_phase_boundary(digits, tmp_path):
    data = digits["train"].select(range(256))

    def make(out, callbacks=()):
        args = DPTrainingArguments(
            output_dir=str(out), target_epsilon=2.0, target_delta=1e-4, max_steps=6, trainable_blocks=1, lp_steps=2,
            lp_per_device_train_batch_size=32,
            per_device_train_batch_size=16, learning_rate=1e-2, report_to="none", save_strategy="steps",
            save_steps=1, disable_tqdm=True, seed=0)
        return DPTrainer(model=tiny_vit(), args=args, train_dataset=data, callbacks=list(callbacks))

    full = make(tmp_path / "full")
    full.train()
    killed = make(tmp_path / "run", [_StopAt(3)])  # stops in phase 2, one step after the boundary
    killed.train()
    assert killed.ledger.steps_done == 3 and killed.ledger.phase_index() == 1
    resumed = make(tmp_path / "run")
    block_at_kill = resumed.model.vit.layers[3].mlp.fc1.weight.detach().clone()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.history == full.ledger.history and len(resumed.ledger.history) == 2
    assert resumed.epsilon() == full.epsilon()
    assert not torch.equal(resumed.model.vit.layers[3].mlp.fc1.weight, block_at_kill)  # phase-2 scope trains
    assert torch.equal(resumed.model.vit.layers[0].mlp.fc1.weight, tiny_vit().vit.layers[0].mlp.fc1.weight)
