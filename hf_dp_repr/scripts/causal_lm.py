"""DP fine-tuning of a causal language model with `DPTrainer`, for `python` or `accelerate launch`.

Offline default: the docstrings of Python's standard library (real English that ships with Python), split by
document into public / private / test parts; a BPE tokenizer trained locally with `tokenizers` on the PUBLIC part
only (when no tokenizer can be fetched); a 2-block GPT-2 pre-trained non-privately on the public part, then
fine-tuned under DP on the disjoint private part. Metric: perplexity = exp(eval loss).

    python recipes/dp_causal_lm.py --output_dir out/lm-eps8 --target_epsilon 8 --target_delta 1e-5

Two CPU processes (gloo), or several GPUs:

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/dp_causal_lm.py \
        --output_dir out/lm-ddp --target_epsilon 8 --target_delta 1e-5 --max_steps 20
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/dp_causal_lm.py \
        --config recipes/configs/gpt2_wikitext2_eps3.yaml

GPT-2 on wikitext-2 (needs Hub access), pushed with its DP model card:

    accelerate launch recipes/dp_causal_lm.py --model_name_or_path gpt2 --dataset_name wikitext \
        --dataset_config_name wikitext-2-raw-v1 --eval_split validation --block_size 128 \
        --target_epsilon 3 --target_delta 1e-5 --push_to_hub --hub_model_id me/gpt2-wikitext2-dp \
        --output_dir out/gpt2-eps3

`--model_name_or_path`: Hub name, local folder, or a built-in tiny config (`tiny_gpt2`, `tiny_llama`).
`--dataset_name`: `stdlib-paragraphs` (embedded: one docstring paragraph per row; its old name `stdlib-docs` still
works), a `save_to_disk` folder, or anything `datasets.load_dataset` takes.
Unit of privacy: one document by default (`--privacy_unit document_id`: blocks never cross documents, each
block remembers its document, and DP-SGD samples, clips and accounts whole documents, see
`hf_dp_repr.data.document_blocks`); `--privacy_unit block` protects one block of `--block_size` tokens (documents
concatenated into blocks, as in most LM fine-tuning scripts). Every DP option: `--help`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from hf_dp_repr.data import (
    DOCUMENT_ID,
    STDLIB_PARAGRAPHS,
    document_blocks,
    embedded_name,
    load_embedded,
    unique_documents,
)
from hf_dp_repr.data.model_files import explained_load_errors
from hf_dp_repr.data.tokenizer import train_tokenizer
from hf_dp_repr.data.user_data import check_column
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.scripts import checks, dp_defaults, recipe_report, repr_compare
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import (
    AnalysisArguments,
    DefaultsArguments,
    LoraArguments,
    PublicPretrainingArguments,
    ScriptArguments,
)
from hf_dp_repr.training.arguments import DPTrainingArguments, check_privacy_unit
from hf_dp_repr.training.trainer import DPTrainer

logger = logging.getLogger("hf_dp_repr.recipes.lm")


@dataclass
class LMArguments(repr_compare.ComparisonArguments, AnalysisArguments, PublicPretrainingArguments, DefaultsArguments,
                  LoraArguments, ScriptArguments):
    """Model and data of the causal-LM recipe (the shared fields: `hf_dp_repr.scripts.arguments`)."""

    model_name_or_path: str = field(default="tiny_gpt2", metadata={
        "help": "Hub name (gpt2), local folder, or built-in tiny config (tiny_gpt2, tiny_llama)."})
    dataset_name: str = field(default=STDLIB_PARAGRAPHS, metadata={
        "help": "'stdlib-paragraphs' (embedded, offline; old name 'stdlib-docs'), a save_to_disk folder, or a "
                "datasets.load_dataset name."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Tokenizer (Hub name or folder); default: the model's. When none can be loaded, a BPE tokenizer is "
                "trained locally on the PUBLIC text (never on the private text)."})
    tokenizer_vocab_size: int = field(default=512, metadata={"help": "Vocabulary of a locally trained tokenizer."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int = field(default=64, metadata={"help": "Tokens per training example (one unit of privacy)."})
    max_eval_blocks: int | None = field(default=None, metadata={"help": "Evaluate on at most this many blocks."})
    public_epochs: float = field(default=15, metadata={"help": "Epochs of the non-private public pre-training."})
    analysis_max_examples: int | None = field(default=256, metadata={"help": "Analyse at most this many blocks."})
    sample_prompt: str = field(default="Return the", metadata={
        "help": "Prompt of the sample the DP model generates (greedy) for the result table; '' for none."})
    sample_max_new_tokens: int = field(default=24, metadata={"help": "Length of that sample, in tokens."})
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "With LoRA: comma-separated module names, or 'all-linear' (the LM head excluded)."})


ARGUMENT_TYPES = (LMArguments, DPTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (perplexity, ε, ...)."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    repr_compare.check_arguments(margs, targs)
    by_document = document_level(targs, margs.given_options)
    name = margs.model_name_or_path
    embedded = embedded_name(ru.dataset_name(margs) or "") is not None  # the shipped demo text, not the user's
    public_fraction = margs.resolved_public_fraction(ru.is_tiny(name), embedded, name)

    docs, held_out = load_documents(margs, targs.seed)
    public_docs, private_docs = (None, docs["train"]) if public_fraction == 0 else ru.split_public_private(
        docs["train"], public_fraction, targs.seed)
    tokenizer = load_or_train_tokenizer(margs, public_docs, save_dir=targs.output_dir)
    model = _load_model(name, tokenizer, margs.block_size, targs.seed)
    blocks = {k: to_blocks(d, tokenizer, margs) for k, d in
              (("private", private_docs), ("eval", docs["eval"]), ("public", public_docs)) if d is not None}
    if by_document:  # the private blocks only: public pre-training and evaluation are the same in both modes
        blocks["private"] = document_blocks(private_docs, tokenizer, margs.block_size).with_format("torch")
    if margs.max_eval_blocks:
        blocks["eval"] = blocks["eval"].select(range(min(margs.max_eval_blocks, len(blocks["eval"]))))
    defaults = dp_defaults.fill_in_language(targs, margs, checks.private_count(blocks["private"], targs), model,
                                            pretrained=not ru.is_tiny(name))  # what the user did not set
    plan = checks.check_before_work(model, blocks["private"], targs)  # before any work, before anything is written
    recipe_report.default_logging(targs, plan.planned_steps, margs.given_options)

    public_path = name  # the weights before any private data: a Hub name, or the public pre-training's folder
    if public_docs is not None:
        save_dir = margs.public_model_dir or os.path.join(targs.output_dir, "public_pretrained")
        signature = dict(model=name, dataset=ru.dataset_name(margs) or margs.train_file,
                         config=margs.dataset_config_name,
                         fraction=public_fraction, seed=targs.seed, epochs=margs.public_epochs,
                         lr=margs.public_learning_rate, batch=margs.public_batch_size, block=margs.block_size,
                         vocab=len(tokenizer))
        path = ru.pretrain_on_public(model, blocks["public"], save_dir=save_dir, training_args=targs,
                                     epochs=margs.public_epochs, learning_rate=margs.public_learning_rate,
                                     batch_size=margs.public_batch_size, signature=signature, log=logger.info)
        model, public_path = type(model).from_pretrained(path), path

    callbacks = []
    if margs.analyze_representations:
        from hf_dp_repr.analysis import RepresentationLawCallback

        callbacks.append(RepresentationLawCallback(blocks["eval"], task="causal-lm",
                                                   max_examples=margs.analysis_max_examples))
    card_info = ModelCardInfo(
        model_name=f"{name} fine-tuned on {ru.data_description(margs)}",
        base_model=None if ru.is_tiny(name) else name,
        base_model_description=(f"{name} (built-in tiny config, random init), pre-trained here on the public data"
                                if ru.is_tiny(name) and public_docs is not None else name),
        datasets=ru.hub_datasets(margs),
        private_data=(f"{len(blocks['private'])} blocks of {'at most ' if by_document else ''}{margs.block_size} "
                      f"tokens from {len(private_docs)} documents of the '{margs.train_split}' split of "
                      f"{ru.data_description(margs)}; " + ("one document (all its blocks) is one unit of privacy"
                                                           if by_document else "one block is one unit of privacy")
                      + (f"; {held_out}" if held_out else "")),
        public_data=(f"{len(public_docs)} other documents of the same split (disjoint), used for non-private "
                     "pre-training" + (" and to train the tokenizer" if getattr(tokenizer, "_trained_here", False)
                                       else "")
                     if public_docs is not None else f"the pre-trained weights and tokenizer of {name}"),
        analysis_data=f"{len(blocks['eval'])} blocks of the '{margs.eval_split}' split (not trained on)",
    )
    trainer = DPTrainer(model=model, args=targs, train_dataset=blocks["private"], eval_dataset=blocks["eval"],
                        processing_class=tokenizer, callbacks=callbacks, peft_config=margs.lora_config(default=False),
                        model_card_info=card_info)
    trainer.plan_notes = recipe_report.plan_notes([held_out] if held_out else [], defaults)
    result = ru.train(trainer, margs.overwrite_output_dir)
    metrics = ru.finish_run(trainer, result, margs, push=push, extra_metrics=_perplexity,
                            extra_rows=lambda t: _sample(t, margs))
    if margs.compare_representations and trainer.is_world_process_zero():
        _compare(trainer, margs, public_path, blocks["eval"])
    return metrics


def _compare(trainer, margs: LMArguments, public_path: str, evals) -> dict:
    """PR_l by layer of the public model, the DP model and the non-private reference on the eval blocks."""
    from transformers import AutoModelForCausalLM

    models = {"public (before private data)": lambda: AutoModelForCausalLM.from_pretrained(public_path),
              f"DP (ε = {trainer.epsilon():.3g})": lambda: trainer.model}
    if margs.reference_model_dir:
        models[repr_compare.reference_label(margs.reference_model_dir)] = (
            lambda: AutoModelForCausalLM.from_pretrained(margs.reference_model_dir))
    return repr_compare.compare(models, evals.select_columns(["input_ids"]), trainer.args.output_dir,
                                task="causal-lm", max_examples=margs.comparison_max_examples,
                                title=f"{margs.model_name_or_path} on {margs.dataset_name}, held-out blocks")


def document_level(targs: DPTrainingArguments, given: set[str]) -> bool:
    """The recipe's unit of privacy: one document unless `--privacy_unit block` (or `row`) is given."""
    unit = targs.privacy_unit if "privacy_unit" in given else DOCUMENT_ID
    if unit not in (DOCUMENT_ID, "block", "row"):
        raise RecipeArgumentError(f"--privacy_unit {unit}: the causal-LM recipe supports '{DOCUMENT_ID}' (default) and "
                                  "'block'.")
    targs.privacy_unit = DOCUMENT_ID if unit == DOCUMENT_ID else "row"
    check_privacy_unit(targs)
    return unit == DOCUMENT_ID


def _perplexity(metrics: dict) -> dict:
    return {"eval_perplexity": math.exp(metrics["eval_loss"])} if "eval_loss" in metrics else {}


def _sample(trainer, margs: LMArguments) -> dict:
    """A greedy continuation of `--sample_prompt` by the DP model, for the result table."""
    import torch

    if not margs.sample_prompt or margs.sample_max_new_tokens < 1:
        return {}
    tok, model = trainer.processing_class, trainer.model
    inputs = tok(margs.sample_prompt, return_tensors="pt").to(model.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=margs.sample_max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    model.train(was_training)
    text = tok.decode(out[0], skip_special_tokens=True)
    return {"sample (greedy, DP model)": repr(text)}


# ---- data ------------------------------------------------------------------------------------------------------
def load_documents(margs: LMArguments, seed: int = 42):
    """({"train", "eval"} datasets with one document per row in `text`, each distinct text once across both (see
    `unique_documents`): the public / private split of "train" is then disjoint by content, not only by row; a note
    for the card when the eval split was held out of the training rows, else None)."""

    if embedded_name(ru.dataset_name(margs) or "") == STDLIB_PARAGRAPHS:
        paragraphs = load_embedded(STDLIB_PARAGRAPHS)  # deduplicated across its splits already
        return {"train": paragraphs["train"], "eval": paragraphs["test"]}, None
    raw = ru.load_raw(margs)
    check_column(next(iter(raw.values())).column_names, margs.text_column, (), "--text_column")
    out = {}
    *splits, held_out = ru.pick_splits(raw, margs, seed)
    for key, ds in zip(("train", "eval"), splits):
        if margs.text_column != "text":
            ds = ds.rename_column(margs.text_column, "text")
        out[key] = ds.filter(lambda t: bool(t.strip()), input_columns="text")
    keep_train, keep_eval = unique_documents(out["train"]["text"], out["eval"]["text"], indices=True)
    return {"train": out["train"].select(keep_train), "eval": out["eval"].select(keep_eval)}, held_out


def to_blocks(docs, tokenizer, margs: LMArguments):
    """Tokenise, concatenate (documents separated by EOS) and cut into blocks of `block_size`; labels = input_ids."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [row + [eos] for row in ids]}

    def group(batch):
        flat = [t for row in batch["ids"] for t in row]
        n = len(flat) // margs.block_size * margs.block_size
        blocks = [flat[i:i + margs.block_size] for i in range(0, n, margs.block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * margs.block_size for _ in blocks],
                "labels": [list(b) for b in blocks]}

    tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names)
    return tokens.map(group, batched=True, batch_size=1000, remove_columns=["ids"]).with_format("torch")


def load_or_train_tokenizer(margs: LMArguments, public_docs, save_dir: str):
    from transformers import AutoTokenizer

    name = margs.tokenizer_name or (None if ru.is_tiny(margs.model_name_or_path) else margs.model_name_or_path)
    if name is not None:
        try:
            tok = AutoTokenizer.from_pretrained(name)
            if tok.eos_token_id is None:
                raise RecipeArgumentError(f"tokenizer {name} has no EOS token; the recipe separates documents with it")
            return tok
        except OSError as err:
            logger.warning("tokenizer %s cannot be loaded (%s); training one locally on the public text", name,
                           type(err).__name__)
    if public_docs is None:
        raise RecipeArgumentError("no tokenizer could be loaded and there is no public data to train one on (a "
                                  "tokenizer trained on the private text would leak it). Give --tokenizer_name or "
                                  "--public_fraction.")
    return train_tokenizer(public_docs["text"], margs.tokenizer_vocab_size)


def _load_model(name, tokenizer, block_size, seed):
    vocab = len(tokenizer)
    if ru.is_tiny(name):
        if name not in ("tiny_gpt2", "tiny_llama"):
            raise RecipeArgumentError(f"--model_name_or_path {name}: the language recipe's tiny configs are tiny_gpt2, "
                                      "tiny_llama.")
        kw = dict(n_positions=max(64, block_size)) if name == "tiny_gpt2" else dict(
            max_position_embeddings=max(64, block_size))
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
        return ru.TINY_MODELS[name](vocab_size=vocab, seed=seed, **kw, **ids)
    from transformers import AutoModelForCausalLM

    with explained_load_errors(name):  # a truncated weights file: name it and the fix
        model = AutoModelForCausalLM.from_pretrained(name)
    if model.get_input_embeddings().num_embeddings < vocab:
        model.resize_token_embeddings(vocab)
    return model


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("causal_lm"))  # as recipes/*.py
