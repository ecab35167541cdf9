"""Layer selection by block indices and named groups (`trainable_groups`): exactly the selected parameters train."""

import re

import pytest
import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError, ScopeError
from hf_dp_repr.scope import phase_scopes
from hf_dp_repr.scope.groups import select_groups
from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2, tiny_llama, tiny_vit
from utils import make_token_classification_dataset, make_token_dataset

# By hand, from the parameter names of each tiny model (not from the code under test): a regex per named group.
MODELS = {
    "vit": (tiny_vit, "digits", {
        "attention": r"vit\.layers\.\d\.attention\.", "mlp": r"vit\.layers\.\d\.mlp\.",
        "norms": r"layernorm", "biases": r"\.bias$", "head": r"^classifier\."}),
    "gpt2": (tiny_gpt2, "tokens", {  # the LM head is tied to the token embeddings: one tensor
        "attention": r"transformer\.h\.\d\.attn\.", "mlp": r"transformer\.h\.\d\.mlp\.",
        "norms": r"\.ln_(1|2|f)\.", "biases": r"\.bias$", "head": r"^transformer\.wte\."}),
    "bert": (tiny_bert_classifier, "labelled_tokens", {
        "attention": r"encoder\.layer\.\d\.attention\.(self|output\.dense)\.",
        "mlp": r"encoder\.layer\.\d\.(intermediate|output)\.dense\.",
        "norms": r"LayerNorm", "biases": r"\.bias$", "head": r"^classifier\."}),
    "llama": (lambda: tiny_llama(attention_bias=True, mlp_bias=True), "tokens", {
        "attention": r"model\.layers\.\d\.self_attn\.", "mlp": r"model\.layers\.\d\.mlp\.",
        "norms": r"(layernorm|model\.norm)\.", "biases": r"\.bias$", "head": r"^lm_head\."}),
}


def dataset_for(kind, digits):
    if kind == "digits":
        return digits["train"].select(range(64))
    if kind == "tokens":
        return make_token_dataset(n=32)
    return make_token_classification_dataset(n=32)


def train(model, dataset, tmp_path, noise_multiplier=0.01, **kw):
    # A small σ with a fixed noise seed: every trained parameter moves, and a trained parameter without a
    # per-sample gradient would make the DP optimizer raise.
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, learning_rate=1e-2,
                               noise_multiplier=noise_multiplier, accountant="rdp", max_steps=2, report_to="none",
                               save_strategy="no", disable_tqdm=True, seed=0, noise_seed=0, **kw)
    DPTrainer(model=model, args=args, train_dataset=dataset).train()


def assert_exactly_changed(model, before, expected):
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert expected, "the hand-written expectation selects nothing"
    assert changed == expected, (f"trained but not selected: {sorted(changed - expected)}; selected but unchanged: "
                                 f"{sorted(expected - changed)}")


@pytest.mark.parametrize("group", ["attention", "mlp", "norms", "biases", "head"])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_named_group_trains_exactly_its_parameters(name, group, digits, tmp_path):
    make, data, patterns = MODELS[name]
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, dataset_for(data, digits), tmp_path, trainable_groups=group)
    expected = {n for n in before if re.search(patterns[group], n)}
    assert_exactly_changed(model, before, expected)


@pytest.mark.parametrize("spec,blocks", [("first:1", [0]), ("every_other", [0, 2]), ("every_other:odd", [1, 3]),
                                         ([0, -1], [0, 3]), ("last:2", [2, 3])])
def test_block_selectors_and_unions(spec, blocks, digits, tmp_path):
    model = tiny_vit()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    union = (spec if isinstance(spec, list) else [spec]) + ["biases", "head"]  # a union: blocks + BitFit + head
    train(model, digits["train"].select(range(64)), tmp_path, trainable_groups=union)
    expected = {n for n in before if re.match(rf"vit\.layers\.({'|'.join(map(str, blocks))})\.", n)
                or n.endswith(".bias") or n.startswith("classifier.")}
    assert_exactly_changed(model, before, expected)


def test_lp_then_groups_trains_the_head_first(digits, tmp_path):
    scopes = phase_scopes(tiny_vit(), None, 2, trainable_groups="norms")
    assert [s.description for s in scopes] == ["linear probe: head (classifier)", "norms"]


def test_trainable_table_shows_the_selection(digits, tmp_path):
    logger = logging.get_logger("hf_dp_repr.trainer")
    with CaptureLogger(logger) as cl:
        # σ = 1: at log level INFO the run ends with its attack-rate bounds, a privacy loss distribution that takes
        # minutes for σ = 0.01 (the table does not depend on σ)
        train(tiny_vit(), digits["train"].select(range(64)), tmp_path, noise_multiplier=1.0,
              trainable_groups="norms,head", log_level="info")
    assert "trains norms + head (classifier)" in cl.out
    # 9 LayerNorms of width 64 (2 per block + the final one), weight and bias each, + the 64×10 head and its bias
    assert re.search(rf"trainable\s+{9 * 2 * 64 + 650:,}  of 136,138", cl.out)
    assert re.search(r"vit\.layers\.0\s+256\n", cl.out)  # the table's row of block 0: its two norms


def test_bad_selections_name_the_argument_and_the_valid_values(digits, tmp_path):
    with pytest.raises(ValueError, match="trainable_groups: unknown selector 'nroms'.*norms.*first:k"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_groups="head,nroms")
    with pytest.raises(ValueError, match="trainable_blocks and trainable_groups are both set"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_groups="head",
                            trainable_blocks=1)
    with pytest.raises(ScopeError, match="block index 4 is out of range.*4 blocks, valid indices are 0..3"):
        select_groups(tiny_vit(), [4])
    with pytest.raises(ScopeError, match="'first:5' asks for 5 blocks, but vit.layers has 4"):
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_groups="first:5",
                                   report_to="none")
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    with pytest.raises(ScopeError, match="'biases' selects no parameters in LlamaForCausalLM"):
        select_groups(tiny_llama(), "biases")


# ---- one vocabulary: trainable_blocks=k is the short form of trainable_groups="last:k,final,head" ----------------
SPELLED = {  # dropout in every block, so that a frozen block run in train mode would change the update
    "vit": (lambda: tiny_vit(attention_probs_dropout_prob=0.2), "digits"),
    "bert": (lambda: tiny_bert_classifier(num_hidden_layers=3, hidden_dropout_prob=0.2), "labelled_tokens"),
    "gpt2": (lambda: tiny_gpt2(n_layer=3, resid_pdrop=0.2), "tokens"),  # a head tied to wte: nothing is cached
}


def trained(make, dataset, tmp_path, **kw):
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, learning_rate=1e-2,
                               noise_multiplier=0.5, accountant="rdp", max_steps=2, report_to="none",
                               save_strategy="no", disable_tqdm=True, seed=0, noise_seed=0, **kw)
    trainer = DPTrainer(model=make(), args=args, train_dataset=dataset)
    names = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()
    return trainer, names


@pytest.mark.parametrize("name,k", [("vit", 1), ("vit", 0), ("bert", 2), ("gpt2", 1)])
def test_trainable_blocks_is_the_short_form_of_last_k_final_head(name, k, digits, tmp_path):
    make, kind = SPELLED[name]
    data = dataset_for(kind, digits)
    short, short_names = trained(make, data, tmp_path / "blocks", trainable_blocks=k)
    spec = f"last:{k},final,head" if k else "head"  # k = 0: the linear probe
    long, long_names = trained(make, data, tmp_path / "groups", trainable_groups=spec)
    assert short_names == long_names
    # the same frozen-prefix handling: eval mode and the same caches (the prefix's states, or the probe's inputs)
    short_cache, long_cache = short.features, long.features
    assert (short_cache.prefix_states is None, short_cache.cached_head) == \
        (long_cache.prefix_states is None, long_cache.cached_head)
    if name == "vit":
        assert (long_cache.prefix_states is not None) if k else (long_cache.cached_head == "classifier")
    for (n, a), b in zip(short.model.named_parameters(), long.model.parameters()):
        assert torch.equal(a, b), n  # the same update, bit for bit (same seeds, same noise)


def test_final_names_the_modules_after_the_stack():
    cases = {"vit": (tiny_vit(), "vit.layernorm."), "gpt2": (tiny_gpt2(), "transformer.ln_f."),
             "bert": (tiny_bert_classifier(), "bert.pooler."), "llama": (tiny_llama(), "model.norm.")}
    for name, (model, prefixes) in cases.items():
        scope = select_groups(model, "final")
        chosen = {id(p) for p in scope.parameters}
        got = {n for n, p in model.named_parameters() if id(p) in chosen}
        assert got and got == {n for n, _ in model.named_parameters() if n.startswith(prefixes)}, name
    assert select_groups(tiny_vit(), "last:1,final").description == \
        "blocks 3 of 4 (vit.layers) + final (vit.layernorm)"


def test_head_alone_is_the_linear_probe(tmp_path):
    scope = select_groups(tiny_vit(), "head")
    assert scope.head_only and scope.description == "linear probe: head (classifier)"
    with pytest.raises(DPConfigError, match="lp_steps with trainable_groups='head'.*linear-probe twice"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_groups="head", lp_steps=2)


def test_a_registered_group_is_a_selector_like_the_others(tmp_path):
    from hf_dp_repr.scope.groups import GROUPS, register_group

    @register_group("embeddings")
    def embeddings(model, stack):
        return list(model.base_model.embeddings.parameters()), "embeddings"

    try:
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, trainable_groups="embeddings,head")
        model = tiny_vit()
        scope = select_groups(model, "embeddings,head")
        assert scope.description == "embeddings + head (classifier)"
        chosen = {id(p) for p in scope.parameters}
        assert {n for n, p in model.named_parameters() if id(p) in chosen} == {
            n for n, _ in model.named_parameters() if n.startswith(("vit.embeddings.", "classifier."))}
    finally:
        del GROUPS["embeddings"]
    with pytest.raises(ScopeError, match="unknown selector 'embeddings'"):
        select_groups(tiny_vit(), "embeddings")
