"""The start-of-training checks in proportion (issue 43, item 4): the probe on 2 examples of a text batch cut to a
few tokens (past each row's first supervised token), still refusing what it refused, run once per model and collator,
its cost in the plan line."""

import re

import pytest
from torch import nn
from transformers import default_data_collator
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import NotPrivatizableError
from hf_dp_repr.privacy.probe_batch import PROBE_TOKENS
from hf_dp_repr.privacy.row_probe import probe_training_rows
from hf_dp_repr.privacy.sampler import ExampleBatchCollator
from hf_dp_repr.tiny import tiny_llama
from utils import make_token_dataset

LENGTH = 48  # tokens per row: longer than the probe's cut


def args_for(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=1, noise_multiplier=1.0,
                report_to="none", save_strategy="no", disable_tqdm=True, learning_rate=0.1, optim="sgd")
    return DPTrainingArguments(**{**base, **kw})


def prompt_masked(dataset, prompt: int):
    """Labels -100 on the first `prompt` tokens of every row (an SFT prompt)."""
    return dataset.map(lambda r: {"labels": [-100] * prompt + r["labels"][prompt:].tolist()}).with_format("torch")


def token_shapes(model) -> tuple[list, object]:
    shapes = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    return shapes, handle


class CentredInTraining(nn.Module):
    """Batch centring in training: mixes examples."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


def test_probe_runs_on_two_rows_of_a_few_tokens(tmp_path):
    """Seen failing without the cut: the model saw (3, 48) then (4, 48)."""
    data = make_token_dataset(n=16, length=LENGTH)
    data = data.map(lambda r: {"attention_mask": [1] * LENGTH, "labels": r["input_ids"]}).with_format("torch")
    model = tiny_llama()
    trainer = DPTrainer(model=model, args=args_for(tmp_path), train_dataset=data)
    shapes, handle = token_shapes(model)
    probe_training_rows(trainer, data, ExampleBatchCollator(default_data_collator))
    handle.remove()
    assert shapes == [(2, PROBE_TOKENS), (3, PROBE_TOKENS)]


def test_the_cut_extends_past_each_rows_first_supervised_token(tmp_path):
    """With the first 40 tokens of every row unsupervised, a cut at 16 tokens leaves every loss 0 and a model that
    mixes examples passes (seen: accepted when the cut ignored the labels); cut at 41 tokens, it is refused."""
    data = prompt_masked(make_token_dataset(n=16, length=LENGTH).map(
        lambda r: {"attention_mask": [1] * LENGTH, "labels": r["input_ids"]}), prompt=40)
    model = tiny_llama()
    model.model.norm = nn.Sequential(model.model.norm, CentredInTraining())
    trainer = DPTrainer(model=model, args=args_for(tmp_path), train_dataset=data)
    shapes, handle = token_shapes(model)
    with pytest.raises(NotPrivatizableError, match=r"(?s)an example's loss changes.*model\.norm\.1 "
                                                   r"\(CentredInTraining\)"):
        probe_training_rows(trainer, data, ExampleBatchCollator(default_data_collator))
    handle.remove()
    assert shapes[:2] == [(2, 41), (3, 41)]


def test_a_model_that_mixes_examples_is_refused_on_the_cut_batch(tmp_path):
    data = make_token_dataset(n=16, length=LENGTH)
    model = tiny_llama()
    model.model.norm = nn.Sequential(model.model.norm, CentredInTraining())
    trainer = DPTrainer(model=model, args=args_for(tmp_path), train_dataset=data)
    with pytest.raises(NotPrivatizableError, match=r"model\.norm\.1 \(CentredInTraining\)"):
        trainer.train()
    assert trainer.ledger is None


def test_the_probe_runs_once_per_model_and_collator(tmp_path):
    """The plan line gives the probe's cost; a second probe of the same model, collator and data reuses the first's
    result (seen failing without the cache: 2 more forwards); other trained tensors or another collator are probed
    again."""
    data = make_token_dataset(n=16, length=LENGTH)
    model = tiny_llama()
    trainer = DPTrainer(model=model, args=args_for(tmp_path, log_level="info"), train_dataset=data)
    with CaptureLogger(hf_logging.get_logger("hf_dp_repr.trainer")) as cl:
        trainer.train()
    assert re.search(r"start-of-training probe: \d+\.\d s", cl.out), cl.out
    shapes, handle = token_shapes(model)
    dataset, collator = trainer._train_dataset_and_collator()
    trainer.start_checks.probe(trainer, dataset, collator, None)
    assert shapes == [] and trainer.start_checks.seconds is None
    assert "start-of-training probe: reused" in trainer.start_checks.describe()
    model.lm_head.weight.requires_grad_(False)
    trainer.start_checks.probe(trainer, dataset, collator, None)
    assert len(shapes) == 2
    trainer.start_checks.probe(trainer, dataset, collator, None)
    assert len(shapes) == 2
    model.lm_head.weight.requires_grad_(True)
    trainer.data_collator = lambda features: default_data_collator(features)
    trainer.start_checks.probe(trainer, dataset, collator, None)
    handle.remove()
    assert len(shapes) == 4 and trainer.start_checks.seconds > 0
