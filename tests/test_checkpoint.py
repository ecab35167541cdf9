"""Checkpoint weights (checkpoints/weights.py): resuming restores exactly the weights that were checkpointed (every
tensor, for every model kind), and `load_best_model_at_end` loads the best checkpoint's weights; a checkpoint that does
not fit is refused."""

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import CheckpointMismatchError
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama, tiny_vit
from hf_dp_repr.training.checkpoints.weights import load_checkpoint_weights
from utils import make_token_classification_dataset, make_token_dataset

STOP = 2


class Snapshots(TrainerCallback):
    """Copies of the model's tensors: at each save (what the checkpoint holds) and at train begin (what a
    resumed run starts from, after the Trainer has loaded the checkpoint)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.saved, self.begin, self.end = stop_at, {}, None, None

    @staticmethod
    def _copy(model):
        return {n: t.detach().clone() for n, t in model.state_dict().items()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.begin = self._copy(model)

    def on_save(self, args, state, control, model=None, **kwargs):
        self.saved[state.global_step] = self._copy(model)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.end = self._copy(model)


def _lora_vit():
    return tiny_vit(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                  modules_to_save=["classifier"])


CASES = {
    "vit": lambda: (tiny_vit(), None),
    "gpt2": lambda: (tiny_gpt2(), None),
    "bert": lambda: (tiny_bert_classifier(), None),
    "llama": lambda: (tiny_llama(), None),
    "lora_vit": _lora_vit,
}


def _data(name, digits):
    if "vit" in name:
        return digits["train"].select(range(48))
    return make_token_classification_dataset(48) if name == "bert" else make_token_dataset(48)


def _trainer(name, out, data, callbacks, eval_dataset=None, **overrides):
    model, peft_config = CASES[name]()
    kwargs = dict(output_dir=str(out), noise_multiplier=1.0, target_delta=1e-3, per_device_train_batch_size=8,
                  max_steps=4, save_strategy="steps", save_steps=STOP, learning_rate=0.05, report_to="none",
                  disable_tqdm=True, seed=0)
    kwargs.update(overrides)
    return DPTrainer(model=model, args=DPTrainingArguments(**kwargs), train_dataset=data, peft_config=peft_config,
                     eval_dataset=eval_dataset, callbacks=callbacks)


def _assert_same(actual, expected):
    assert actual.keys() == expected.keys()
    differ = [n for n in expected if not torch.equal(actual[n], expected[n])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ from the checkpoint, e.g. {differ[:3]}"


@pytest.mark.parametrize("name", list(CASES))
def test_resume_restores_every_tensor_of_the_checkpoint(name, digits, tmp_path):
    data = _data(name, digits)
    killed = Snapshots(stop_at=STOP)
    _trainer(name, tmp_path, data, [killed]).train()
    resumed = Snapshots()
    fresh = _trainer(name, tmp_path, data, [resumed])
    initial = {n: t.detach().clone() for n, t in fresh.model.state_dict().items()}
    fresh.train(resume_from_checkpoint=True)
    assert fresh.state.global_step == 4
    _assert_same(resumed.begin, killed.saved[STOP])
    trained = [n for n, p in fresh.model.named_parameters() if p.requires_grad]
    assert any(not torch.equal(initial[n], resumed.begin[n]) for n in trained)  # the test can see a load


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(digits, tmp_path):
    data = digits["train"].select(range(48))
    snaps, evals = Snapshots(), []

    def first_eval_is_best(_prediction):  # the checkpoint of step 1 is the best, not the last one
        evals.append(len(evals))
        return {"order": evals[-1]}

    trainer = _trainer("vit", tmp_path, data, [snaps], save_steps=1, eval_strategy="steps", eval_steps=1,
                       load_best_model_at_end=True, metric_for_best_model="order", greater_is_better=False,
                       eval_dataset=digits["test"].select(range(16)))
    trainer.compute_metrics = first_eval_is_best
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1") and len(evals) == 4
    _assert_same(snaps.end, snaps.saved[1])
    assert any(not torch.equal(snaps.end[n], snaps.saved[4][n]) for n in snaps.end)


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(digits, tmp_path):
    data = digits["train"].select(range(48))
    _trainer("vit", tmp_path, data, [Snapshots(stop_at=STOP)]).train()
    weights = tmp_path / f"checkpoint-{STOP}" / "model.safetensors"
    state = load_file(str(weights))
    del state["classifier.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(weights))
    with pytest.raises(CheckpointMismatchError, match="classifier.bias") as e:
        _trainer("vit", tmp_path, data, []).train(resume_from_checkpoint=True)
    assert "extra.weight" in str(e.value) and str(weights.parent) in str(e.value)


@pytest.mark.parametrize("end", ["mid_epoch", "epoch_boundary"])
def test_resuming_a_finished_run_is_a_logged_no_op(end, digits, tmp_path):
    data = digits["train"].select(range(48))  # 6 steps per epoch at batch 8
    schedule = dict(max_steps=4, save_steps=2) if end == "mid_epoch" else dict(
        max_steps=-1, num_train_epochs=1, save_steps=3)
    snaps = Snapshots()
    first = _trainer("vit", tmp_path, data, [snaps], **schedule)
    first.train()
    last = max(snaps.saved)
    ledger_file = tmp_path / f"checkpoint-{last}" / "privacy_ledger.json"
    ledger_text = ledger_file.read_text()

    again = _trainer("vit", tmp_path, data, [], **schedule)
    logger = logging.get_logger("hf_dp_repr")
    with CaptureLogger(logger) as log:
        out = again.train(resume_from_checkpoint=True)
    assert log.out.count("nothing to resume") == 1 and f"checkpoint-{last}" in log.out
    assert again.ledger.steps_done == first.ledger.steps_done == last
    assert out.metrics["epsilon"] == again.epsilon() == first.epsilon()
    assert again.state.global_step == last and ledger_file.read_text() == ledger_text
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == sorted(f"checkpoint-{s}" for s in snaps.saved)
    _assert_same({n: t for n, t in again.model.state_dict().items()}, snaps.saved[last])


def test_loading_keeps_the_live_tensors_their_flags_and_ties(tmp_path):
    """The optimizer, Opacus hooks and frozen scopes hold the live parameters: loading copies into them."""
    for make in (tiny_vit, tiny_gpt2):
        source = make(seed=1)
        source.save_pretrained(str(tmp_path / make.__name__))
        model = make(seed=0)
        params = dict(model.named_parameters(remove_duplicate=False))
        frozen = next(iter(params))
        params[frozen].requires_grad_(False)
        load_checkpoint_weights(model, str(tmp_path / make.__name__))
        after = dict(model.named_parameters(remove_duplicate=False))
        assert all(after[n] is p for n, p in params.items()) and not after[frozen].requires_grad
        _assert_same(model.state_dict(), source.state_dict())
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2's head is still its input embedding


def test_a_plain_torch_module_checkpoint_is_loaded_strictly(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    saved = {k: v + 1 for k, v in model.state_dict().items()}
    save_file(saved, str(tmp_path / "model.safetensors"))
    load_checkpoint_weights(model, str(tmp_path))
    _assert_same(model.state_dict(), saved)
    del saved["1.bias"]
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError, match=r"1 tensor\(s\) missing from the checkpoint .*: 1.bias"):
        load_checkpoint_weights(model, str(tmp_path))
