"""`DPSFTTrainer` / `DPSFTConfig`: TRL's `SFTTrainer` under DP-SGD (`dp_trainer_class(SFTTrainer)` and SFT's checks).

SFTTrainer prepares the data as usual: conversational rows (`messages`, rendered with the tokenizer's chat template)
or prompt/completion rows, tokenised, with `labels` -100 outside the tokens the loss sees (`assistant_only_loss`:
the assistant's turns, from the template's `{% generation %}` markers; `completion_only_loss`: the completion).
DPTrainer then trains on it: one row (one conversation, whatever its length) is one example, its loss the mean over
its own loss tokens (`privacy.loss`), its gradient clipped to C; with `privacy_unit="user_id"` all the
conversations of a user are one unit, sampled, summed and clipped together. `max_length` truncates a conversation
(it stays one row: TRL drops a row left without loss tokens); packing and padding-free batches, which put several
conversations in one row, are refused before any work (`check_sft_arguments`).

What is logged: the training loss and ε, as DPTrainer logs them (the loss is computed on private data and not
covered by the guarantee). SFTTrainer's token accuracy, entropy and token count are computed in its `compute_loss`,
which DP training never calls: none is logged for training; in evaluation they are logged like the eval loss.

Example (a tiny Llama-style chat model, 2 DP steps on conversations from Python's docstrings, CPU, seconds):
    >>> from hf_dp_repr.tiny import tiny_llama
    >>> from hf_dp_repr.trl import DPSFTConfig, DPSFTTrainer
    >>> from hf_dp_repr.trl.chat_data import chat_tokenizer, stdlib_conversations
    >>> chats = stdlib_conversations(max_conversations=64, max_per_user=4)
    >>> tok = chat_tokenizer(["What does this do? It returns the value."] * 20, vocab_size=300)
    >>> args = DPSFTConfig(output_dir="/tmp/dp-sft-doc", target_epsilon=8.0, target_delta=1e-4,
    ...     assistant_only_loss=True, per_device_train_batch_size=8, max_steps=2, max_length=64,
    ...     privacy_unit="user_id", report_to="none", save_strategy="no", disable_tqdm=True)
    >>> trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=args, train_dataset=chats,
    ...                        processing_class=tok)
    >>> out = trainer.train()
    {'train_runtime': ...}
    >>> trainer.ledger.steps_done, trainer.ledger.plan.privacy_unit
    (2, 'user_id')
"""

from __future__ import annotations

import dataclasses

import torch
from trl import SFTConfig, SFTTrainer

from ..errors import DPConfigError, UnsupportedError
from ..hub.card import ModelCardInfo
from .mechanism import dp_config_class, dp_trainer_class

_ONE_ROW = ("DP-SGD clips, samples and accounts one row as one example; {what} puts several examples (conversations) "
            "in one row, where they share one clipped gradient, so removing one could move the update by more than C. "
            "Set {fix}.")


def check_sft_arguments(args) -> None:
    """Refuse, before any work, the SFTConfig options that cannot keep one example per row or that DP training
    would ignore (each error names the option and its fix)."""
    if args.packing:
        raise DPConfigError("DPSFTConfig: packing=True is refused: " + _ONE_ROW.format(
            what="packing", fix="packing=False (each conversation is then one padded row)"))
    if args.padding_free:
        raise DPConfigError("DPSFTConfig: padding_free=True is refused: " + _ONE_ROW.format(
            what="padding-free batching (the batch flattened into one row)", fix="padding_free=False and "
            "packing=False"))
    if args.activation_offloading:
        raise DPConfigError("DPSFTConfig: activation_offloading=True is refused: it wraps SFTTrainer's training step, "
                            "which DPTrainer's replaces, so it would be ignored. Set activation_offloading=False.")
    if args.loss_type not in ("nll", "dft"):
        raise DPConfigError(f"DPSFTConfig: loss_type={args.loss_type!r}: use 'nll' or 'dft' (both per example).")


@dataclasses.dataclass
class DPSFTConfig(dp_config_class(SFTConfig, "_DPSFTFields")):
    """The arguments of `DPSFTTrainer`: every `trl.SFTConfig` field and every `DPTrainingArguments` field (one
    dataclass: `HfArgumentParser`, YAML configs and TRL's CLI flags work). TRL's defaults are kept (learning_rate
    2e-5, logging_steps 10, max_length 1024, ...) except `gradient_checkpointing` (off: under DP-SGD it needs
    `gradient_checkpointing_kwargs={"use_reentrant": True}`) and `bf16` (on only where the GPU supports it, off on a
    CPU). `packing` and `padding_free` are refused (`check_sft_arguments`)."""

    def __post_init__(self):
        check_sft_arguments(self)
        super().__post_init__()


def _loss_tokens(args, first: dict) -> str:
    """Which tokens of an example the loss saw, for the card."""
    if "input_ids" in first:
        return "the tokens whose `labels` are not -100 in the given pre-tokenised rows" if "labels" in first else (
            "every token of the given pre-tokenised rows")
    parts = []
    if args.assistant_only_loss:
        parts.append("the assistant's tokens only (`assistant_only_loss`: the chat template's generation blocks)")
    if "prompt" in first and args.completion_only_loss is not False:
        parts.append("the completion's tokens only (`completion_only_loss`)")
    return "; ".join(parts) or "every token of the example (prompt and answer)"


def _what_an_example_is(first: dict) -> str:
    if "messages" in first or "conversations" in first:
        return "one conversation (`messages`, rendered with the chat template), whatever its length"
    if "prompt" in first:
        kind = "conversational " if isinstance(first["prompt"], list) else ""
        return f"one {kind}prompt/completion pair"
    return "one text (one row of the training set)"


_Base = dp_trainer_class(SFTTrainer, config_class=DPSFTConfig, name="_DPSFTBase")


class DPSFTTrainer(_Base):
    """TRL's `SFTTrainer` under DP-SGD: the same arguments (`model` (a model or a Hub name), `args` (a
    `DPSFTConfig`), `train_dataset`, `processing_class`, `peft_config`, `formatting_func`, ...) by keyword, plus
    DPTrainer's `model_card_info`. See the module docstring for what one example is and what is logged."""

    def __init__(self, model=None, args: DPSFTConfig | None = None, train_dataset=None, **kwargs):
        if isinstance(args, DPSFTConfig):
            check_sft_arguments(args)  # again: fields may be set after the config was built
        first = train_dataset[0] if train_dataset is not None and len(train_dataset) else {}
        if "image" in first or "images" in first:
            raise UnsupportedError("DPSFTTrainer: vision-language SFT (an `image`/`images` column) is not tested "
                                   "under DP-SGD; train on text, or use DPTrainer with your own collator.")
        if model is not None and not isinstance(model, str) and isinstance(args, DPSFTConfig):
            _check_no_router_loss(model, args)
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        info = ModelCardInfo.from_value(self.model_card_info)
        self.model_card_info = dataclasses.replace(
            info, training_example=info.training_example or _what_an_example_is(first),
            loss_tokens=info.loss_tokens or _loss_tokens(self.args, first))

    def per_example_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Each example's mean token loss over its own loss tokens; `loss_type="dft"` weights each token's
        -log p by p (detached), as SFTTrainer does, still averaged per example."""
        if self.args.loss_type != "dft":
            return super().per_example_loss(outputs, labels)
        logits, labels = outputs.logits[:, :-1].float(), labels[:, 1:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        mask = labels != -100
        token_loss = torch.where(mask, -logp * logp.detach().exp(), torch.zeros_like(logp))
        return token_loss.sum(1) / mask.sum(1).clamp(min=1)


def _check_no_router_loss(model, args) -> None:
    """A mixture-of-experts load-balancing loss is computed over the whole batch's tokens: refuse it."""
    text_config = model.config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef:
        raise DPConfigError(f"DPSFTConfig: router_aux_loss_coef={coef}: the mixture-of-experts load-balancing loss "
                            "is computed over the whole batch's tokens, so one example would move every other "
                            "example's loss. Set router_aux_loss_coef=0.")


__all__ = ["DPSFTConfig", "DPSFTTrainer", "check_sft_arguments"]
