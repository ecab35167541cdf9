"""DP supervised fine-tuning of a chat model with TRL (`hf_dp_repr.trl.DPSFTTrainer`), for `python` or `accelerate
launch`: LoRA on a Llama-style model, the loss on the assistant's tokens only, one USER (all their conversations) per
unit of privacy; then the saved model answers a question through its chat template (`generate()`).

Offline default: a 2-block Llama-style model built from a config (random init), a byte-level BPE tokenizer trained
here on PUBLIC text (the docstrings of Python modules that are not users of the data, `chat_data.public_text`) with a
chat template whose assistant turns sit in `{% generation %}` blocks, and private conversations about Python's
standard library (`chat_data.stdlib_conversations`: each module is a user; held-out users are the eval set).

    python recipes/dp_sft.py --config recipes/configs/dp_sft_tiny_llama.yaml --output_dir out/sft
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/dp_sft.py \
        --config recipes/configs/dp_sft_tiny_llama.yaml --output_dir out/sft-fsdp \
        --fsdp full_shard --fsdp_config '{"fsdp_version": 2}'

A real run (Hub model and data; NOT measured here): SmolLM2-1.7B-Instruct with LoRA r=16 on all linear layers, bf16,
on one GPU (a ~20 GB estimate: 3.4 GB of bf16 weights, activations of 8 sequences of 1024 tokens with the ghost
engine's per-layer inputs and output gradients kept for the clipping, no per-example gradient of the base weights):

    accelerate launch recipes/dp_sft.py --model_name_or_path HuggingFaceTB/SmolLM2-1.7B-Instruct \
        --dataset_name me/support-chats --privacy_unit user_id --assistant_only_loss true \
        --lora_target_modules all-linear --lora_r 16 --target_epsilon 8 --target_delta 1e-6 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 32 --num_train_epochs 3 --max_length 1024 \
        --learning_rate 1e-3 --output_dir out/smollm2-dp-sft --push_to_hub --hub_model_id me/smollm2-dp-sft

`--dataset_name`: `stdlib-chats` (built offline), a `save_to_disk` folder or a Hub dataset with `messages` (or
prompt/completion) rows and, for user-level privacy, a `--privacy_unit` column. A Hub model's chat template must mark
the assistant's turns with `{% generation %}` for `--assistant_only_loss true`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from hf_dp_repr.data.gguf_models import description
from hf_dp_repr.data.user_data import warn_row_level_users
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.scripts import checks, dp_defaults, recipe_report, repr_compare
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import DefaultsArguments, LoraArguments, ScriptArguments
from hf_dp_repr.trl.sft import DPSFTConfig, DPSFTTrainer

logger = logging.getLogger("hf_dp_repr.recipes.sft")
STDLIB_CHATS = "stdlib-chats"
USER_ID = "user_id"


@dataclass
class ChatArguments(repr_compare.ComparisonArguments, LoraArguments, ScriptArguments):
    """Model, data and LoRA of the SFT and DPO recipes."""

    BUILT_IN_DATASETS = (STDLIB_CHATS,)  # built offline by this recipe, not looked up on the Hub (check_names)

    model_name_or_path: str = field(default="tiny_llama", metadata={
        "help": "Hub name or local folder of a causal LM, or the built-in tiny config 'tiny_llama'."})
    dataset_name: str = field(default=STDLIB_CHATS, metadata={
        "help": f"'{STDLIB_CHATS}' (built offline), a save_to_disk folder, a folder or file of json/jsonl/parquet "
                "chats, or a datasets.load_dataset name (or give --train_file)."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Tokenizer with a chat template (default: the model's; for tiny_llama one is trained on public text)."})
    tokenizer_vocab_size: int = field(default=512, metadata={"help": "Vocabulary of a locally trained tokenizer."})
    max_conversations: int | None = field(default=600, metadata={"help": f"'{STDLIB_CHATS}': at most this many."})
    max_per_user: int | None = field(default=15, metadata={"help": f"'{STDLIB_CHATS}': conversations per user."})
    eval_users: int = field(default=2, metadata={"help": f"'{STDLIB_CHATS}': users held out for evaluation."})
    sample_question: str = field(default="In json, what does this do: dumps?", metadata={
        "help": "A question the saved model answers through its chat template (greedy) for the result table."})
    sample_max_new_tokens: int = field(default=24, metadata={"help": "Length of that answer, in tokens."})


@dataclass
class SFTArguments(DefaultsArguments, ChatArguments):
    """The SFT recipe's: `ChatArguments` and the DP-aware defaults' switch."""


ARGUMENT_TYPES = (SFTArguments, DPSFTConfig)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (eval loss, ε, ...)."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    repr_compare.check_arguments(margs, targs)
    if "privacy_unit" not in margs.given_options and ru.dataset_name(margs) == STDLIB_CHATS:
        targs.privacy_unit = USER_ID  # user-level privacy by default on the built-in data
    train, evaluation, held_out = load_chats(margs, targs.seed)
    warn_row_level_users(train.column_names, targs.privacy_unit)
    tokenizer = load_tokenizer(margs)
    model = load_model(margs, tokenizer, targs)
    defaults = dp_defaults.fill_in_language(targs, margs, checks.private_count(train, targs), model,
                                            pretrained=not ru.is_tiny(margs.model_name_or_path))
    peft_config = margs.lora_config(default=True)
    if margs.compare_representations and peft_config is None:
        raise RecipeArgumentError("--compare_representations needs --use_lora true: without adapters the recipe keeps "
                                  "no copy of the base weights to compare with (compare with `hf-dp-repr analyze`).")
    unit = "one user (all their conversations)" if targs.privacy_unit == USER_ID else "one conversation"
    card_info = ModelCardInfo(
        model_name=f"{margs.model_name_or_path} chat-tuned on {ru.data_description(margs)}",
        base_model=None if ru.is_tiny(margs.model_name_or_path) else margs.model_name_or_path,
        base_model_description=("a 2-block Llama-style model built from a config (random init)"
                                if ru.is_tiny(margs.model_name_or_path) else description(margs.model_name_or_path)
                                or margs.model_name_or_path),
        private_data=f"{len(train)} conversations of the '{margs.train_split}' split of {ru.data_description(margs)}; "
                     f"{unit} is one unit of privacy" + (f"; {held_out}" if held_out else ""),
        public_data=("the docstrings of Python modules that are no user of the data (the tokenizer was trained on "
                     "them)" if getattr(tokenizer, "_trained_here", False) else "the base model and its tokenizer"))
    trainer = DPSFTTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                           processing_class=tokenizer, peft_config=peft_config, model_card_info=card_info)
    trainer.plan_notes = recipe_report.plan_notes([held_out] if held_out else [], defaults)
    result = ru.train(trainer, margs.overwrite_output_dir)
    metrics = ru.finish_run(trainer, result, margs, push=push, extra_rows=lambda t: answer(t, margs))
    if margs.compare_representations and trainer.is_world_process_zero() and trainer.eval_dataset is not None:
        _compare(trainer, margs)
    return metrics


def _compare(trainer, margs: SFTArguments) -> dict:
    """Next-token PR_l by layer of the base model (public), the DP model and the non-private reference, on the
    held-out conversations (every token: the chat template's and the user's too)."""
    out = trainer.args.output_dir
    models = {"public (base model)": lambda: _base_of(out),
              f"DP (ε = {trainer.epsilon():.3g})": lambda: trainer.model}
    if margs.reference_model_dir:
        models[repr_compare.reference_label(margs.reference_model_dir)] = (
            lambda: load_saved(margs.reference_model_dir))
    return repr_compare.compare(models, trainer.eval_dataset.select_columns(["input_ids"]), out, task="causal-lm",
                                max_examples=margs.comparison_max_examples,
                                title=f"{margs.model_name_or_path} on {margs.dataset_name}, held-out conversations")


def _base_of(out: str):
    """The weights before any private data: the adapters' base model (a name, or a folder relative to `out`)."""
    from transformers import AutoModelForCausalLM

    from hf_dp_repr.data import adapter_base_path

    return AutoModelForCausalLM.from_pretrained(adapter_base_path(out))


def load_saved(out: str):
    """A saved run of this recipe: its base model with its LoRA adapters, or its full weights."""
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(out, "adapter_config.json")):
        return AutoModelForCausalLM.from_pretrained(out)
    from peft import PeftModel

    return PeftModel.from_pretrained(_base_of(out), out)


def load_chats(margs: SFTArguments, seed: int = 42):
    """(train, eval, note) conversation datasets. The built-in data holds out the last `eval_users` users whole; the
    user's own data without an eval split has a share of its rows held out (`note` says so, for the plan and the
    card; None otherwise)."""
    if ru.dataset_name(margs) == STDLIB_CHATS:
        from hf_dp_repr.trl.chat_data import stdlib_conversations

        chats = stdlib_conversations(max_conversations=margs.max_conversations, max_per_user=margs.max_per_user)
        users = list(dict.fromkeys(chats[USER_ID]))
        held_out = set(users[-margs.eval_users:]) if margs.eval_users else set()
        if len(held_out) >= len(users):
            raise RecipeArgumentError(f"--eval_users {margs.eval_users} leaves no user to train on.")
        return (chats.filter(lambda u: u not in held_out, input_columns=USER_ID),
                chats.filter(lambda u: u in held_out, input_columns=USER_ID) if held_out else None, None)
    return ru.pick_splits(ru.load_raw(margs), margs, seed)


def load_tokenizer(margs: SFTArguments):
    name = margs.tokenizer_name or (None if ru.is_tiny(margs.model_name_or_path) else margs.model_name_or_path)
    if name is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    from hf_dp_repr.trl.chat_data import chat_tokenizer, public_text

    tok = chat_tokenizer(public_text(), margs.tokenizer_vocab_size)  # public text only: never the conversations
    tok._trained_here = True
    return tok


def load_model(margs: SFTArguments, tokenizer, targs):
    """A Hub/local causal LM, or tiny_llama sized for the tokenizer. A tiny base is saved in output_dir/base_model
    first, so that the saved adapters name a base model `generate()` can load again."""
    name = margs.model_name_or_path
    if not ru.is_tiny(name):
        return name  # DPSFTTrainer loads it (model_init_kwargs), as SFTTrainer does
    if name != "tiny_llama":
        raise RecipeArgumentError(f"--model_name_or_path {name}: the SFT recipe's built-in config is 'tiny_llama'.")
    from transformers import AutoModelForCausalLM

    from hf_dp_repr.tiny import tiny_llama

    base = os.path.join(targs.output_dir, "base_model")
    if targs.should_save and not os.path.isdir(base):
        model = tiny_llama(vocab_size=len(tokenizer), seed=targs.seed, max_position_embeddings=max(
            64, targs.max_length or 64), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        model.save_pretrained(base)
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return AutoModelForCausalLM.from_pretrained(base)


def answer(trainer, margs: SFTArguments) -> dict:
    """The saved model (reloaded from output_dir: the base and the DP adapters) answers `--sample_question`
    through the chat template, greedily (rank 0 only: a fresh model, no collective)."""
    if not margs.sample_question or margs.sample_max_new_tokens < 1 or not trainer.is_world_process_zero():
        return {}
    import torch
    from transformers import AutoTokenizer

    out = trainer.args.output_dir
    model = load_saved(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": margs.sample_question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    model.eval()
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=margs.sample_max_new_tokens, do_sample=False,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    reply = tok.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"answer (greedy, saved DP model)": repr(reply)}
