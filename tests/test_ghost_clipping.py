"""The ghost-norm / book-keeping engine against a brute-force loop, and against the Opacus-hooks engine."""

import copy

import pytest
import torch

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine, unsupported_reason
from hf_dp_repr.privacy.grad_samplers import batch_position_ids
from hf_dp_repr.privacy.loss import is_causal_lm, per_example_loss
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama, tiny_vit

B, T = 5, 12


def token_batch(vocab=128, labels="lm", seed=0):
    """Right-padded rows of different lengths (pad id 0, label -100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, 3, 7, 5, T - 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = ids * mask
    y = ids.masked_fill(mask == 0, -100) if labels == "lm" else torch.randint(0, 2, (B,), generator=g)
    return {"input_ids": ids, "attention_mask": mask}, y


def lora_gpt2():
    from peft import LoraConfig

    from hf_dp_repr.scope.lora import apply_peft_config

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False)
    return apply_peft_config(tiny_gpt2(), cfg)


def vit_at_another_size():
    """An 8-px ViT run on 12-px images: its position embeddings interpolated (data.images.interpolate_positions)."""
    from hf_dp_repr.data.images import interpolate_positions

    model = tiny_vit()
    interpolate_positions(model)
    return model


CASES = {  # name: (model factory, batch factory)
    "vit": (lambda: tiny_vit(), lambda: ({"pixel_values": torch.randn(B, 1, 8, 8)}, torch.arange(B))),
    "vit_interpolated": (vit_at_another_size, lambda: ({"pixel_values": torch.randn(B, 1, 12, 12)}, torch.arange(B))),
    "gpt2_tied": (lambda: tiny_gpt2(), lambda: token_batch()),
    "bert": (lambda: tiny_bert_classifier(), lambda: token_batch(labels="class")),
    "llama": (lambda: tiny_llama(), lambda: token_batch()),
    "lora": (lora_gpt2, lambda: token_batch()),
}


def losses_of(model, inputs, labels):
    inputs = dict(inputs)
    batch_position_ids(model, inputs)
    return per_example_loss(model(**inputs).logits, labels, shift_labels=is_causal_lm(model))


def brute_force(model, inputs, labels):
    """Each example's gradient, computed alone (its own padding kept)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(B):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        out.append(torch.autograd.grad(losses_of(model, one, labels[i:i + 1]).sum(), params))
    return params, out


@pytest.mark.parametrize("name", list(CASES))
def test_norms_and_clipped_sum_equal_brute_force(name):
    make_model, make_batch = CASES[name]
    model = make_model().double().train()
    inputs, labels = make_batch()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    assert unsupported_reason(model) is None
    params, per_example = brute_force(model, inputs, labels)
    engine = GhostClippingEngine(model)
    with engine.recording():
        losses_of(model, inputs, labels).sum().backward()
    assert all(p.grad is None for p in params)  # book-keeping: autograd formed no unclipped gradient
    norms = engine.squared_norms()
    assert set(norms) == set(params)
    for j, p in enumerate(params):
        want = torch.stack([g[j].pow(2).sum() for g in per_example])
        torch.testing.assert_close(norms[p], want, rtol=1e-5, atol=1e-12)
    total = torch.stack([sum(norms[p] for p in params)]).squeeze(0).sqrt()
    clip = total.median()  # some examples clipped, some not
    c = (clip / (total + 1e-6)).clamp(max=1.0)
    assert (c < 1).any() and (c == 1).any()
    sums = engine.clipped_sums({p: c for p in params})
    for j, p in enumerate(params):
        want = sum(c[i] * per_example[i][j] for i in range(B))
        torch.testing.assert_close(sums[p], want, rtol=1e-5, atol=1e-10)
    if name == "gpt2_tied":
        assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight in norms
    engine.remove()


def test_ghost_layers_hold_no_per_example_gradient():
    """Memory: no (batch, *shape) tensor for the large tensors, whatever the batch."""
    model = tiny_gpt2(n_embd=64)
    inputs, labels = token_batch()
    engine = GhostClippingEngine(model)
    with engine.recording():
        losses_of(model, inputs, labels).sum().backward()
    engine.squared_norms()
    materialised = {p for p in engine.explicit if p.dim() >= 2}
    assert not materialised  # Conv1D weights (64×192 ...) and the tied 128×64 embedding are ghost-normed
    pieces = engine._pieces
    weight = model.transformer.h[0].attn.c_attn.weight
    assert all(t.numel() < B * weight.numel() for _, *data in pieces[weight] for t in data if torch.is_tensor(t))


def test_explicit_gradient_is_chosen_when_cheaper():
    layer = torch.nn.Linear(3, 2)  # T² (p+q) = 64·5 > T p q = 8·6
    engine = GhostClippingEngine(layer)
    x = torch.randn(B, 8, 3)
    with engine.recording():
        layer(x).sum().backward()
    engine.squared_norms()
    assert layer.weight in engine.explicit


def test_unsupported_module_is_reported():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.s

    assert "no per-example rule" in unsupported_reason(torch.nn.Sequential(Scale()))


def train_update(engine, digits, tmp_path, **kw):
    model = tiny_vit()
    start = copy.deepcopy(model.state_dict())
    args = DPTrainingArguments(output_dir=str(tmp_path / engine), per_device_train_batch_size=8,
                               gradient_accumulation_steps=2, max_steps=2, learning_rate=0.1, optim="sgd",
                               report_to="none", save_strategy="no", disable_tqdm=True, noise_multiplier=0.0,
                               noise_seed=1, per_sample_max_grad_norm=5.0, clipping_engine=engine, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=digits["train"].select(range(64)))
    trainer.train()
    assert trainer.clipping_engine == engine
    return {k: model.state_dict()[k] - start[k] for k in start}


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_two_engines_give_the_same_update(clipping, digits, tmp_path):
    ghost = train_update("ghost", digits, tmp_path, clipping=clipping)
    hooks = train_update("hooks", digits, tmp_path, clipping=clipping)
    num = sum((ghost[k] - hooks[k]).double().pow(2).sum() for k in ghost)
    den = sum(hooks[k].double().pow(2).sum() for k in ghost)
    assert den > 0 and (num / den).sqrt() <= 1e-5


def test_ghost_refused_and_auto_falls_back(digits, tmp_path, caplog):
    from transformers.utils import logging

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.s

    model = tiny_vit()
    model.classifier = torch.nn.Sequential(model.classifier, Scaled())
    args = dict(output_dir=str(tmp_path), max_steps=1, report_to="none", noise_multiplier=1.0, disable_tqdm=True,
                save_strategy="no", per_device_train_batch_size=8)
    data = digits["train"].select(range(32))
    with pytest.raises(ValueError, match="clipping_engine='ghost'"):
        DPTrainer(model=model, args=DPTrainingArguments(clipping_engine="ghost", **args), train_dataset=data).train()
    logging.enable_propagation()
    trainer = DPTrainer(model=model, args=DPTrainingArguments(**args), train_dataset=data)
    with caplog.at_level("WARNING"):
        trainer.train()  # Opacus computes the module's per-sample gradients with functorch
    assert trainer.clipping_engine == "hooks" and "falls back to Opacus hooks" in caplog.text


def test_frozen_part_is_not_hooked_and_scope_norms_are_exact():
    """trainable_blocks-style scope: only modules owning a trained tensor are hooked; norms still exact."""
    model = tiny_vit().double().train()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("vit.layers.3.", "vit.layernorm", "classifier")))
    engine = GhostClippingEngine(model)
    names = {m: n for n, m in model.named_modules()}
    assert engine.modules and all(names[m].startswith(("vit.layers.3", "vit.layernorm", "classifier"))
                                  for m in engine.modules)
    inputs, labels = {"pixel_values": torch.randn(B, 1, 8, 8).double()}, torch.arange(B)
    params, per_example = brute_force(model, inputs, labels)
    with engine.recording():
        losses_of(model, inputs, labels).sum().backward()
    norms = engine.squared_norms()
    for j, p in enumerate(params):
        torch.testing.assert_close(norms[p], torch.stack([g[j].pow(2).sum() for g in per_example]), rtol=1e-5,
                                   atol=1e-12)


def test_small_tensors_are_formed_in_the_backward_and_their_inputs_freed():
    """Memory: a LayerNorm's per-example gradients (B, d) are formed as its output gradient arrives; its input and
    output gradient (B, T, d) are not held until the clip factors are known (they were, before)."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    seen = []
    model[1].register_forward_hook(lambda m, inputs, out: seen.append(weakref.ref(inputs[0])))
    engine = GhostClippingEngine(model)
    with engine.recording():
        model(torch.randn(B, 7, 32)).pow(2).sum().backward()
    ln = model[1]
    assert [tuple(t.shape) for _, t in engine._pieces[ln.weight]] == [(B, 32)]
    assert seen[0]() is None  # the LayerNorm's input is gone
    big = [p for p in (model[0].weight, model[2].weight) if engine._pieces[p][0][0] == "factors"]
    assert big == [model[0].weight]  # 32·3 ≤ 7·(32+3) < 32·32: the last layer's per-example gradient was formed at once
    assert set(engine.squared_norms()) == set(model.parameters())


def test_input_modified_in_place_after_forward_is_refused():
    layer = torch.nn.Linear(4, 4)
    engine = GhostClippingEngine(layer)
    x = torch.randn(B, 3, 4)
    with engine.recording(), pytest.raises(RuntimeError, match="modified in place"):
        out = layer(x)
        x.add_(1.0)
        out.pow(2).sum().backward()


def test_a_subclass_with_its_own_forward_is_not_factored():
    """A scaled embedding (Gemma's, BART's) returns 3·E[ids]: factoring it as an Embedding gave norms 3× too small."""
    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    assert "no per-example rule" in unsupported_reason(torch.nn.Sequential(Scaled(10, 4)))
    assert unsupported_reason(torch.nn.Sequential(torch.nn.Embedding(10, 4))) is None
