"""Rows that are not examples (issue 22, items 2 and 5): modules whose first dimension is not the example (T5's
relative position bias, sequence-first attention), several rows per example (OPT's MLP), LayerNorm without bias,
trained tensors used outside their module, and collators or models that mix examples. Each is either clipped
exactly (one DP step against a per-example brute-force loop, both engines) or refused before any step."""

import copy

import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn
from transformers import OPTConfig, OPTForCausalLM, T5Config, T5ForConditionalGeneration, default_data_collator
from transformers.utils import ModelOutput

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError, NotPrivatizableError
from hf_dp_repr.privacy.batch_rows import ExampleRows, RowsProbe, rows_per_example
from hf_dp_repr.privacy.row_probe import probe_training_rows
from hf_dp_repr.privacy.sampler import ExampleBatchCollator
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import (
    brute_force_update,
    make_token_classification_dataset,
    make_token_dataset,
    relative_error,
    run_one_step,
)

T = 8  # tokens per row in the token datasets


def args_for(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=T, max_steps=2, noise_multiplier=1.0,
                report_to="none", save_strategy="no", disable_tqdm=True, learning_rate=0.1, optim="sgd")
    return DPTrainingArguments(**{**base, **kw})


def refused_before_any_step(model, dataset, tmp_path, error, match, **kw):
    before = copy.deepcopy(model.state_dict())
    collator = kw.pop("data_collator", None)
    trainer = DPTrainer(model=model, args=args_for(tmp_path, **kw), train_dataset=dataset, data_collator=collator)
    with pytest.raises(error, match=match):
        trainer.train()
    assert trainer.ledger is None and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- the first dimension is not the example ---------------------------------------------------------------------
def tiny_t5(freeze_relative_bias: bool) -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                dropout_rate=0.0, relative_attention_num_buckets=8, pad_token_id=0,
                                                decoder_start_token_id=0))
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name and freeze_relative_bias:
            p.requires_grad_(False)
    return model


def t5_dataset():
    return make_token_dataset(length=T).map(
        lambda r: {"decoder_input_ids": [0] + r["labels"][:-1].clamp(min=0).tolist()}).with_format("torch")


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_t5_relative_bias_is_refused_naming_it_with_b_equal_t(engine, tmp_path):
    """Its Embedding is fed (q, k) bucket ids shared by all examples: with B = T = 8 and fixed-size batches nothing
    crashed and one example moved the clipped sum by 2.65·C (the review); now refused before any step."""
    refused_before_any_step(tiny_t5(freeze_relative_bias=False), t5_dataset(), tmp_path, NotPrivatizableError,
                            r"encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias \(Embedding\)",
                            clipping_engine=engine, poisson_sampling=False)


class SeqFirstAttention(nn.Module):
    """PyTorch's default (sequence-first) nn.MultiheadAttention as `ModuleValidator.fix` makes it."""

    def __init__(self, vocab=128, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = ModuleValidator.fix(nn.Sequential(nn.MultiheadAttention(d, 2)))[0]
        self.head = nn.Linear(d, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids).transpose(0, 1)  # (T, B, d)
        out, _ = self.attn(h, h, h)
        return ModelOutput(logits=self.head(out.mean(0)))


def test_sequence_first_attention_is_refused_with_b_equal_t(tmp_path):
    model = SeqFirstAttention()
    assert not model.attn.batch_first
    refused_before_any_step(model, make_token_classification_dataset(length=T), tmp_path, NotPrivatizableError,
                            r"attn\.qlinear \(Linear\) trains parameters but its input has shape \(8, 2, 16\) for 2 "
                            r"examples and \(8, 3, 16\) for 3", poisson_sampling=False)


def test_every_micro_batch_is_checked_and_the_probe_tells_b_equal_t():
    """Per micro-batch, a size check refuses B ≠ T; with B = T only the probe (k and k + 1 rows) can tell."""
    model = SeqFirstAttention().eval()
    rows = ExampleRows(model)
    with rows.expect(3), pytest.raises(NotPrivatizableError, match=r"attn\.qlinear .* shape \(8, 3, 16\) in a "
                                                                   "micro-batch of 3 examples"):
        model(torch.randint(0, 128, (3, T)))
    with rows.expect(T):
        model(torch.randint(0, 128, (T, T)))  # sizes alone cannot see it
    rows.remove()
    ids = torch.randint(0, 128, (T, T))
    with RowsProbe(model, T, copy=False) as first:
        model(ids)
    with RowsProbe(model, T + 1, copy=True) as second:
        model(torch.cat([ids, ids[:1]]))
    with pytest.raises(NotPrivatizableError, match=r"attn\.qlinear"):
        rows_per_example(first, second)


# ---- supported: exact clipping on both engines -----------------------------------------------------------------
def tiny_opt():
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                                    attention_dropout=0.0, pad_token_id=0, word_embed_proj_dim=32))


def gpt2_layer_norm_without_bias():
    model = tiny_gpt2()
    for block in model.transformer.h:
        block.ln_1 = nn.LayerNorm(32, bias=False)
        block.ln_1.weight.data.normal_(1.0, 0.2)
    return model


SUPPORTED = {  # name: (model, dataset)
    "opt": (tiny_opt, make_token_dataset),  # its MLP and final LayerNorm see (B·T, d)
    "layer_norm_without_bias": (gpt2_layer_norm_without_bias, make_token_dataset),
    "t5_frozen_relative_bias": (lambda: tiny_t5(freeze_relative_bias=True), t5_dataset),
}


def median_norm(model, dataset) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(dataset)):
        grads = torch.autograd.grad(model(**{k: v[None] for k, v in dataset[i].items()}).loss, params)
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)).item())
    return float(torch.tensor(norms).median())


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_one_step_equals_brute_force(name, engine, tmp_path):
    make_model, make_data = SUPPORTED[name]
    model, dataset = make_model(), make_data()
    reference = copy.deepcopy(model)
    clip = median_norm(reference, dataset)  # some examples clipped, some not
    grads, batch = run_one_step(model, dataset, tmp_path, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                clipping_engine=engine)
    want = brute_force_update(reference, dataset, batch, clip, "flat")
    assert set(grads) == set(want) and len(batch) > 0
    assert relative_error(grads, want) <= 1e-5


# ---- trained tensors used outside their module -------------------------------------------------------------------
class EmbeddingUsedByHand(nn.Module):
    def __init__(self, vocab=128, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        return ModelOutput(logits=h @ self.embed.weight.T)  # the output layer, outside any module call


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_parameter_used_outside_its_module_is_refused_naming_it(engine, tmp_path):
    """Neither engine saw `h @ E.T`: the clipped gradient was wrong (rel. error 0.22 flat) without a word."""
    refused_before_any_step(EmbeddingUsedByHand(), make_token_dataset(length=T), tmp_path, NotPrivatizableError,
                            r"outside a call of the module that owns them: embed\.weight", clipping_engine=engine)


# ---- collators and models that mix examples ------------------------------------------------------------------------
def mixing_collator(features):
    """Row i = mean of examples i and i + 1 (the review's collator: one example moved the update by 2.21·C/L)."""
    batch = default_data_collator(features)
    pixels = batch["pixel_values"]
    batch["pixel_values"] = (pixels + pixels.roll(-1, 0)) / 2
    return batch


def test_collator_that_mixes_examples_is_refused(digits, tmp_path):
    refused_before_any_step(tiny_vit(), digits["train"].select(range(32)), tmp_path, DPConfigError,
                            "the data collator mixes examples", data_collator=mixing_collator)


def test_collator_copying_a_prefix_the_examples_share_is_refused():
    """Examples sharing their first 3 tokens (a chat template's prefix) hid a collator that copies row 0's first 3
    tokens into every row: replacing one real example by another left the other rows as they were (seen failing:
    accepted). A stand-in differing from the example everywhere moves them; a collator keeping rows apart passes."""
    from hf_dp_repr.privacy.row_probe import check_collator_keeps_examples_apart

    examples = [{"input_ids": [5, 6, 7, 10 + i, 20 + i], "labels": [5, 6, 7, 10 + i, 20 + i]} for i in range(3)]

    def copy_prefix(features):
        batch = default_data_collator(features)
        batch["input_ids"][:, :3] = batch["input_ids"][0, :3].clone()
        return batch

    with pytest.raises(DPConfigError, match="mixes examples: replacing example 0"):
        check_collator_keeps_examples_apart(copy_prefix, examples)
    assert check_collator_keeps_examples_apart(default_data_collator, examples)["input_ids"].tolist() == [
        e["input_ids"] for e in examples]


def test_model_whose_loss_mixes_examples_is_refused(digits, tmp_path):
    class BatchStandardised(nn.Module):  # batch statistics, no running ones: each loss moves by 0.3 % here
        def forward(self, x):
            return (x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5)

    model = tiny_vit()
    model.classifier = nn.Sequential(BatchStandardised(), model.classifier)
    refused_before_any_step(model, digits["train"].select(range(32)), tmp_path, NotPrivatizableError,
                            "an example's loss changes when the other rows of its micro-batch change")


def test_random_collator_that_keeps_examples_apart_trains(token_dataset, tmp_path):
    """A collator drawing random numbers per row (as MLM masking does) is not mistaken for mixing."""
    def drop_tokens(features):
        batch = default_data_collator(features)
        batch["input_ids"] = batch["input_ids"].masked_fill(torch.rand(batch["input_ids"].shape) < 0.2, 1)
        return batch

    trainer = DPTrainer(model=tiny_gpt2(), args=args_for(tmp_path, per_device_train_batch_size=4),
                        train_dataset=token_dataset, data_collator=drop_tokens)
    trainer.train()
    assert trainer.ledger.steps_done == 2


class CentredInTraining(nn.Module):
    """Batch centring in training, a fixed buffer in eval (as a custom normalisation would do): the eval-mode probe
    accepted it, and one outlier moved the clipped sum by 4.39·C (bound 2)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("centre", torch.zeros(d))

    def forward(self, x):
        return x - (x.mean(0, keepdim=True) if self.training else self.centre)


def test_model_that_mixes_examples_only_in_training_is_refused_naming_the_module(digits, tmp_path):
    model = tiny_vit()
    model.classifier = nn.Sequential(CentredInTraining(model.classifier.in_features), model.classifier)
    refused_before_any_step(model, digits["train"].select(range(32)), tmp_path, NotPrivatizableError,
                            r"(?s)an example's loss changes when the other rows.*classifier\.0 \(CentredInTraining\)")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_dropout_is_not_mistaken_for_mixing_and_the_probe_leaves_no_trace(attention, token_dataset, tmp_path):
    """The probe runs in training mode with dropout off (its draws would differ between the two passes), and puts
    back what it changed: the modules' modes and the buffers a training forward may update."""
    model = tiny_gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation=attention)
    trainer = DPTrainer(model=model, args=args_for(tmp_path, per_device_train_batch_size=4, max_steps=1),
                        train_dataset=token_dataset)
    model.eval()
    assert probe_training_rows(trainer, token_dataset, ExampleBatchCollator(default_data_collator)) == set()
    assert not any(m.training for m in model.modules())
    trainer.train()
    assert trainer.ledger.steps_done == 1


def test_the_probe_restores_buffers_a_training_forward_updates(digits, tmp_path):
    class Counting(nn.Module):  # a per-row layer that counts its training calls in a buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            if self.training:
                self.calls += 1
            return x

    model = tiny_vit()
    model.classifier = nn.Sequential(Counting(), model.classifier)
    data = digits["train"].select(range(8))
    trainer = DPTrainer(model=model, args=args_for(tmp_path, per_device_train_batch_size=4), train_dataset=data)
    probe_training_rows(trainer, data, ExampleBatchCollator(default_data_collator))
    assert model.classifier[0].calls.item() == 0 and model.training
