"""LoRA (PEFT) under DP-SGD: per-example clipped gradients of the adapters against brute force, only adapters
(and modules_to_save) move while base weights stay bit-identical, adapter-only and merged saves reload to the
same outputs, and LoRA setups whose gradients would be wrong are refused with the fix."""

import copy
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy.ledger import LEDGER_FILE
from hf_dp_repr.scope.lora import apply_peft_config, check_peft_model
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama, tiny_vit
from utils import ACCUMULATION, BATCH, brute_force_update, make_token_dataset, relative_error, run_one_step

# name: (constructor, LoRA options, dataset kind, Auto class that must load the merged model)
CASES = {
    "vit": (tiny_vit, dict(target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"]), "digits",
            AutoModelForImageClassification),
    "gpt2": (tiny_gpt2, dict(target_modules=["c_attn"], task_type="CAUSAL_LM"), "tokens", AutoModelForCausalLM),
    "bert": (tiny_bert_classifier, dict(target_modules=["query", "value"], task_type="SEQ_CLS"), "labelled",
             AutoModelForSequenceClassification),
    "llama": (tiny_llama, dict(target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"), "tokens",
              AutoModelForCausalLM),
}


def lora_config(name, **overrides):
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **{**CASES[name][1], **overrides})


def labelled_token_dataset(n=24):
    """Token sequences with a class label (parity of the token sum) for sequence classification."""
    rows = make_token_dataset(n).with_format(None).to_dict()
    rows["labels"] = [sum(ids) % 2 for ids in rows["input_ids"]]
    return Dataset.from_dict(rows).with_format("torch")


def dataset_for(name, digits):
    kind = CASES[name][2]
    if kind == "digits":
        return digits["train"].select(range(24))
    return labelled_token_dataset() if kind == "labelled" else make_token_dataset()


def example_norms(model, dataset):
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(dataset)):
        example = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
        grads = torch.autograd.grad(model(**example).loss, params)
        norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item())
    return norms


# Beyond the defaults: LoRA on a Conv2d (ViT's patch projection) and an MLP layer with LoRA biases, per-layer
# clipping; GPT-2 Conv1D with trainable base biases (bias="all") and rsLoRA scaling.
EXTRA = {
    "vit-conv2d-per_layer": ("vit", dict(target_modules=["projection", "q_proj", "fc2"], lora_bias=True), "per_layer"),
    "gpt2-bias_all-rslora": ("gpt2", dict(bias="all", lora_bias=True, use_rslora=True), "flat"),
}
BRUTE_FORCE_CASES = {name: (name, {}, "flat") for name in CASES} | EXTRA


@pytest.mark.parametrize("case", list(BRUTE_FORCE_CASES))
def test_lora_clipped_gradients_equal_brute_force(case, digits, tmp_path):
    """One logical step (σ = 0, GA = 3) of a pre-wrapped PeftModel: the DP update of every LoRA (and
    modules_to_save) parameter equals Σ_i clip_C(∇ loss_i) / L computed one example at a time."""
    name, options, clipping = BRUTE_FORCE_CASES[case]
    dataset = dataset_for(name, digits)
    torch.manual_seed(1)
    # init_lora_weights=False: B ≠ 0, so lora_A gets a non-trivial gradient (with B = 0 it would be exactly 0).
    model = get_peft_model(CASES[name][0](), lora_config(name, init_lora_weights=False, **options))
    reference = copy.deepcopy(model)
    norms = sorted(example_norms(reference, dataset))
    clip = norms[len(norms) // 2]  # the step mixes clipped and unclipped examples
    assert sum(n > clip * 1.01 for n in norms) >= 3 and sum(n < clip * 0.99 for n in norms) >= 3
    grads, batch = run_one_step(model, dataset, tmp_path, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                clipping=clipping)
    assert len(batch) > 0 and BATCH * ACCUMULATION == 12
    want = brute_force_update(reference, dataset, batch, clip, clipping)
    assert set(grads) == set(want)
    assert any(".lora_A." in n for n in want) and any(".lora_B." in n for n in want)
    assert all(".lora_" in n or "modules_to_save" in n or options.get("bias") == "all" for n in want)
    assert all(want[n].abs().sum() > 0 for n in want if ".lora_A." in n)
    err = relative_error(grads, want)
    assert err <= 1e-5, err


@pytest.mark.parametrize("name", list(CASES))
def test_dp_lora_trains_adapters_only_and_saves(name, digits, tmp_path):
    dataset = dataset_for(name, digits)
    base = CASES[name][0]()
    original = {k: v.clone() for k, v in base.state_dict().items()}
    args = DPTrainingArguments(
        output_dir=str(tmp_path / "run"), noise_multiplier=1.0, per_sample_max_grad_norm=1.0, target_delta=1e-3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = DPTrainer(model=base, args=args, train_dataset=dataset, peft_config=lora_config(name))
    model = trainer.model
    assert isinstance(model, PeftModel)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "modules_to_save" in n for n in trainable)
    if name in ("vit", "bert"):
        assert any("modules_to_save" in n for n in trainable)  # the classification head trains
    for n, p in model.named_parameters():
        assert torch.equal(p, start[n]) != (n in trainable), n  # trained ones moved, all others bit-identical
    # Base weights (and the original head kept by modules_to_save) equal those of the model before wrapping.
    seen = set()
    for k, v in model.get_base_model().state_dict().items():
        if ".lora_" in k or ".modules_to_save." in k:
            continue
        key = k.replace(".base_layer", "").replace(".original_module", "")
        assert torch.equal(v, original[key]), k
        seen.add(key)
    assert seen == set(original)

    batch = {k: v for k, v in dataset[:5].items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        want = model(**batch).logits

    trainer.save_model(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "adapters" / "model.safetensors").exists()  # adapters alone, not the base
    assert (tmp_path / "adapters" / LEDGER_FILE).exists()
    reloaded = PeftModel.from_pretrained(CASES[name][0](), str(tmp_path / "adapters")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, want, rtol=0, atol=1e-6)

    after_training = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.save_merged_model(str(tmp_path / "merged"))
    assert (tmp_path / "merged" / LEDGER_FILE).exists()
    merged = CASES[name][3].from_pretrained(str(tmp_path / "merged")).eval()
    assert type(merged) is type(base) and not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, want, rtol=0, atol=1e-5)
    # Merging happened on a copy: the training model still holds unmerged adapters and the same weights.
    assert all(torch.equal(p, after_training[n]) for n, p in model.named_parameters())
    assert not any(getattr(m, "merged", False) for m in model.modules())


# ---- refused setups -------------------------------------------------------------------------------------
def test_target_modules_not_found_names_candidates():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="target_modules") as e:
        apply_peft_config(model, LoraConfig(target_modules=["q_proj"]))
    assert "c_attn: 2 Conv1D" in str(e.value) and "c_fc" in str(e.value)
    with pytest.raises(ValueError) as e:
        apply_peft_config(tiny_llama(), LoraConfig(target_modules=["c_attn"]))
    assert "q_proj: 2 Linear" in str(e.value) and "down_proj" in str(e.value)


def test_gpt2_conv1d_gets_fan_in_fan_out_without_mutating_the_config():
    config = LoraConfig(target_modules=["c_attn"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = apply_peft_config(tiny_gpt2(), config)
    assert not any("fan_in_fan_out" in str(w.message) for w in record)
    assert model.peft_config["default"].fan_in_fan_out is True and config.fan_in_fan_out is False


def test_embedding_targets_are_refused_before_touching_the_model():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="wte .*Embedding"):
        apply_peft_config(model, LoraConfig(target_modules=["wte", "c_attn"]))
    assert not any("lora" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("options, message", [
    (dict(use_dora=True), "use_dora=True"),
    (dict(init_lora_weights="eva"), "init_lora_weights='eva'"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
    (dict(trainable_token_indices=[1, 2]), "trainable_token_indices"),
    (dict(inference_mode=True), "inference_mode=True"),
])
def test_unsupported_lora_options_are_refused(options, message):
    with pytest.raises(ValueError, match="DPTrainer") as e:
        apply_peft_config(tiny_gpt2(), LoraConfig(target_modules=["c_attn"], **options))
    assert message in str(e.value) and "Fix" in str(e.value)


def test_wrong_config_type_and_double_wrapping_are_refused():
    with pytest.raises(TypeError, match="LoraConfig"):
        apply_peft_config(tiny_gpt2(), {"r": 8})
    with pytest.raises(ValueError, match="only LoRA"):
        apply_peft_config(tiny_gpt2(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    wrapped = apply_peft_config(tiny_gpt2(), LoraConfig(target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="already a PeftModel"):
        apply_peft_config(wrapped, LoraConfig(target_modules=["c_attn"]))


def test_prewrapped_models_with_wrong_gradients_are_refused():
    """A PeftModel built outside DPTrainer: DoRA (uses lora_A/lora_B weights outside the layers Opacus hooks) and
    merged adapters (LoRA layers never run) would give silently wrong or missing per-example gradients."""
    dora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="use_dora"):
        check_peft_model(dora)
    merged = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"], init_lora_weights=False))
    merged.merge_adapter()
    with pytest.raises(ValueError, match="unmerge_adapter"):
        check_peft_model(merged)
    check_peft_model(get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"])))  # plain LoRA passes


def test_frozen_classification_head_is_warned():
    with pytest.warns(UserWarning, match="modules_to_save=\\['classifier'\\]"):
        apply_peft_config(tiny_vit(), LoraConfig(target_modules=["q_proj"]))


def test_dp_trainer_refuses_a_prewrapped_dora_model_and_lora_with_trainable_blocks(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, report_to="none")
    dora = get_peft_model(tiny_vit(), LoraConfig(target_modules=["q_proj", "v_proj"], use_dora=True,
                                                 modules_to_save=["classifier"]))
    with pytest.raises(ValueError, match="use_dora"):
        DPTrainer(model=dora, args=args, train_dataset=digits["train"])
    scoped = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_blocks=1, report_to="none")
    with pytest.raises(ValueError, match="either peft_config or trainable_blocks"):
        DPTrainer(model=tiny_vit(), args=scoped, train_dataset=digits["train"],
                  peft_config=LoraConfig(target_modules=["q_proj"], modules_to_save=["classifier"]))


def test_lora_run_resumes_from_a_checkpoint_with_the_same_accounting(digits, tmp_path):
    from utils import StopAt as _StopAt

    data = digits["train"].select(range(64))

    def make(out, callbacks=()):
        args = DPTrainingArguments(output_dir=str(out), target_epsilon=3.0, target_delta=1e-3, max_steps=4,
                                   per_device_train_batch_size=8, learning_rate=0.05, report_to="none",
                                   save_strategy="steps", save_steps=1, disable_tqdm=True, seed=0, noise_seed=0)
        return DPTrainer(model=tiny_vit(), args=args, train_dataset=data, peft_config=lora_config("vit"),
                         callbacks=list(callbacks))

    full = make(tmp_path / "full")
    full.train()
    make(tmp_path / "run", [_StopAt(2)]).train()
    resumed = make(tmp_path / "run")
    adapter = next(p for n, p in resumed.model.named_parameters() if "lora_B" in n)
    assert torch.count_nonzero(adapter) == 0  # a fresh LoRA B; the checkpoint's adapters must be loaded
    resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.history == full.ledger.history and resumed.epsilon() == full.epsilon()
    trained = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    for n, p in full.model.named_parameters():
        if n in trained:  # same noise_seed: the same batches and noise, keyed by epoch and step, across the resume
            torch.testing.assert_close(trained[n], p, rtol=0, atol=1e-4)


def test_lora_target_matching_nothing_with_modules_to_save_lists_the_candidates():
    model = tiny_vit()
    with pytest.raises(ValueError, match=r"DPTrainer: LoRA target modules \['query'\] match no layer") as e:
        apply_peft_config(model, LoraConfig(target_modules=["query"], modules_to_save=["classifier"]))
    assert "q_proj: 4 Linear" in str(e.value) and "fc1: 4 Linear" in str(e.value)
