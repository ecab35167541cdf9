"""DP preference optimisation (DPO) after DP SFT, with TRL (`hf_dp_repr.trl.DPDPOTrainer`), for `python` or
`accelerate launch`: the model that `recipes/dp_sft.py` saved (its DP LoRA adapter merged into its base: that merged
model is the frozen reference) gets a fresh LoRA adapter trained with DPO on preference pairs built from the SAME
private conversations, one user (all their pairs) per unit of privacy; then the saved model answers a question.

Pairs (`conversation_pairs`): the prompt is a conversation up to its last answer, `chosen` that answer, `rejected`
the answer of another conversation of the same user, or a fixed public non-answer (so a pair holds one user's text
only, user-level privacy holds, and the pairs have the same users as the conversations). ε is reported for this run
and, composed with the SFT run's ledger (`sft_ledger`), for SFT then DPO on the same users: `epsilon_sft_then_dpo`,
from the accountant on both runs' steps.

    python recipes/dp_sft.py --config recipes/configs/dp_sft_tiny_llama.yaml --output_dir out/sft
    python recipes/dp_dpo.py --config recipes/configs/dp_dpo_tiny_llama.yaml --sft_model out/sft --output_dir out/dpo

A real run (NOT measured here): `--sft_model` the output folder of a real SFT run (e.g. the SmolLM2-1.7B command of
scripts/sft.py), `--dataset_name` the same conversations, bf16 on one GPU; memory about that SFT run's plus the
activations of the pair's second sequence (a pair is two rows), the reference costing no weights (adapter disabled).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from hf_dp_repr.errors import DataError
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.scripts import checks, dp_defaults, recipe_report
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import DefaultsArguments
from hf_dp_repr.scripts.sft import (
    STDLIB_CHATS,
    USER_ID,
    ChatArguments,
    answer,
    load_chats,
    load_tokenizer,
)
from hf_dp_repr.trl.dpo import DPDPOConfig, DPDPOTrainer

logger = logging.getLogger("hf_dp_repr.recipes.dpo")


@dataclass
class DPOArguments(DefaultsArguments, ChatArguments):
    """The SFT recipe's model, data and LoRA arguments, the DP-aware defaults' switch, and the SFT run to start
    from."""

    sft_model: str | None = field(default=None, metadata={
        "help": "Output folder of recipes/dp_sft.py (its DP adapter is merged into its base; that is the reference). "
                "Without it, DPO starts from --model_name_or_path."})


ARGUMENT_TYPES = (DPOArguments, DPDPOConfig)


NO_ANSWER = "I do not know."  # public text: the rejected answer of a user with a single conversation


def conversation_pairs(chats, unit_column: str = USER_ID):
    """(prompt, chosen, rejected, unit) rows, one per conversation: its last answer is chosen, the answer of the
    user's next conversation (cyclically) rejected, or the public `NO_ANSWER` when the user has no other answer. A pair
    never holds two users' text, and every user of the conversations is a user of the pairs (the number of units is
    the same as the SFT run's, whatever the users' data)."""
    from datasets import Dataset

    by_user: dict = {}
    for messages, user in zip(chats["messages"], chats[unit_column]):
        by_user.setdefault(user, []).append(messages)
    rows = {"prompt": [], "chosen": [], "rejected": [], unit_column: []}
    for user, conversations in by_user.items():
        for i, messages in enumerate(conversations):
            other = conversations[(i + 1) % len(conversations)][-1]["content"]
            rows["prompt"].append(messages[:-1])
            rows["chosen"].append([messages[-1]])
            rejected = other if other != messages[-1]["content"] else NO_ANSWER
            rows["rejected"].append([{"role": "assistant", "content": rejected}])
            rows[unit_column].append(user)
    return Dataset.from_dict(rows)


def preference_rows(data):
    """`data` as preference pairs: as they are when it has prompt / chosen / rejected columns, else built from
    conversations (`messages`) of users (`user_id`) by `conversation_pairs`; else a DataError naming the columns."""
    columns = data.column_names
    if {"prompt", "chosen", "rejected"} <= set(columns):
        return data
    if {"messages", USER_ID} <= set(columns):
        return conversation_pairs(data)
    raise DataError(f"the DPO recipe needs preference pairs (prompt, chosen, rejected columns) or conversations of "
                    f"users (messages, {USER_ID}) to pair; the data has the columns {columns}")


def sft_ledger(sft_model: str | None):
    from hf_dp_repr.privacy.ledger import PrivacyLedger

    if sft_model is None or not os.path.exists(os.path.join(sft_model, "privacy_ledger.json")):
        return None
    return PrivacyLedger.load(sft_model)


def composed_epsilon(sft, dpo) -> float | None:
    """ε of the SFT run's steps then the DPO run's, by the DPO plan's accountant at its δ, when both protect the
    same unit with the same neighbouring relation (None otherwise: no sound composition to report)."""
    from hf_dp_repr.privacy.accounting import compute_epsilon

    if sft is None or sft.plan.privacy_unit != dpo.plan.privacy_unit or sft.plan.neighboring != dpo.plan.neighboring:
        return None
    plan = dpo.plan
    return compute_epsilon(list(sft.history) + list(dpo.history), plan.target_delta, plan.accountant,
                           plan.neighboring)


def load_policy(margs: DPOArguments, tokenizer, targs):
    """The SFT model with its adapter merged, saved as output_dir/base_model (the saved DPO adapter names it)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    from hf_dp_repr.data import adapter_base_path

    if margs.sft_model is None:
        from hf_dp_repr.scripts.sft import load_model

        return load_model(margs, tokenizer, targs)
    base = os.path.join(targs.output_dir, "base_model")
    if targs.should_save and not os.path.isdir(base):
        from peft import PeftModel

        sft = margs.sft_model
        if name := adapter_base_path(sft):
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(name), sft).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(sft)
        model.save_pretrained(base)
    PartialState().wait_for_everyone()
    return AutoModelForCausalLM.from_pretrained(base)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (ε of this run, and composed with the SFT run's)."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    if "privacy_unit" not in margs.given_options and ru.dataset_name(margs) == STDLIB_CHATS:
        targs.privacy_unit = USER_ID
    if margs.sft_model is not None and margs.tokenizer_name is None:
        margs.tokenizer_name = margs.sft_model  # the SFT run saved its tokenizer (and chat template) there
    chats, evaluation, held_out = load_chats(margs, targs.seed)
    given_pairs = {"prompt", "chosen", "rejected"} <= set(chats.column_names)
    train, evaluation = (None if d is None else preference_rows(d) for d in (chats, evaluation))
    tokenizer = load_tokenizer(margs)
    model = load_policy(margs, tokenizer, targs)
    pretrained = margs.sft_model is not None or not ru.is_tiny(margs.model_name_or_path)
    defaults = dp_defaults.fill_in_language(targs, margs, checks.private_count(train, targs), model, pretrained)
    peft_config = margs.lora_config(default=True)
    card_info = ModelCardInfo(
        model_name=f"{margs.sft_model or margs.model_name_or_path} preference-tuned (DPO) on "
                   f"{ru.data_description(margs)}",
        private_data=(f"{len(train)} preference pairs of the '{margs.train_split}' split of "
                      f"{ru.data_description(margs)}" if given_pairs else
                      f"{len(train)} preference pairs built from the '{margs.train_split}' conversations of "
                      f"{ru.data_description(margs)} (chosen: the conversation's answer, rejected: another answer of "
                      "the same user); the DP SFT model it starts from was trained on the same users")
                     + (f"; {held_out}" if held_out else ""),
        public_data="the DP SFT model (its own guarantee is in its card) and its tokenizer")
    trainer = DPDPOTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                           processing_class=tokenizer, peft_config=peft_config, model_card_info=card_info)
    trainer.plan_notes = recipe_report.plan_notes([held_out] if held_out else [], defaults)
    result = ru.train(trainer, margs.overwrite_output_dir)
    composed = composed_epsilon(sft_ledger(margs.sft_model), trainer.ledger)

    def extra(metrics):
        return {} if composed is None else {"epsilon_sft_then_dpo": composed}

    return ru.finish_run(trainer, result, margs, push=push, extra_metrics=extra,
                         extra_rows=lambda t: answer(t, margs))
