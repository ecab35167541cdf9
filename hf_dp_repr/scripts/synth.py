"""DP synthetic text (Yue et al. 2023): DP fine-tuning of a causal LM on labelled text prefixed by control codes,
then sampling N rows per label from the DP model → a `datasets.Dataset` with a card that states its guarantee.

Offline default: `stdlib-topics` (paragraphs of standard-library docstrings labelled by module: the private rows are
its train split), a tokenizer trained locally and a tiny GPT-2 pre-trained non-privately on PUBLIC text (the
docstrings of the other stdlib modules, none of the labelled ones), then fine-tuned under DP on "<module>: <text>"
rows (one paragraph = one unit of privacy), and prompted with "<module>:" to sample rows.

    python recipes/dp_synthetic_text.py --config recipes/configs/synth_stdlib_topics_eps4.yaml
    hf-dp-repr synth --output_dir out/synth --target_epsilon 4 --target_delta 1e-5 --n_per_label 100
    hf-dp-repr synth --model_name_or_path gpt2 --dataset_name my/labelled-text --lora_r 8 ... \\
        --push_to_hub --hub_dataset_id me/dp-synthetic-text        (a dataset repository)

The synthetic rows go to `--synthetic_dir` (default OUTPUT_DIR/synthetic): synthetic.parquet, README.md (the dataset
card: ε, δ, unit, accountant from the model's ledger, and how the rows were made), privacy_ledger.json (the
model's) and synthesis.json (model, prompts = the control codes, sampling parameters, seed). The DP model itself is
saved in OUTPUT_DIR with its DP model card. `--generation_seed` seeds the sampling: post-processing, so it needs no
secrecy. Any scope of DPTrainingArguments works (full, last blocks, LoRA). Every option: `--help`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from hf_dp_repr.data import STDLIB_MODULES, STDLIB_TOPICS, embedded_name, load_embedded, stdlib_docstrings
from hf_dp_repr.data.control_codes import control_rows
from hf_dp_repr.data.tokenizer import padded_rows, train_tokenizer
from hf_dp_repr.data.user_data import check_column, encode_labels
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.scripts import causal_lm as lm
from hf_dp_repr.scripts import checks, recipe_report
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import PublicPretrainingArguments, ScriptArguments
from hf_dp_repr.synth import generate_synthetic, save_synthetic
from hf_dp_repr.training.arguments import DPTrainingArguments
from hf_dp_repr.training.trainer import DPTrainer

logger = logging.getLogger("hf_dp_repr.recipes.synth")


@dataclass
class SynthArguments(PublicPretrainingArguments, ScriptArguments):
    """Model, data and sampling of the synthetic-text recipe."""

    model_name_or_path: str = field(default="tiny_gpt2", metadata={
        "help": "Hub name (gpt2), local folder, or built-in tiny config (tiny_gpt2, tiny_llama)."})
    dataset_name: str = field(default=STDLIB_TOPICS, metadata={
        "help": "'stdlib-topics' (embedded, offline), a save_to_disk folder, a folder or file of csv/json/jsonl/"
                "parquet data, or a Hub dataset, with a text and a label column (the labels' names are the control "
                "codes)."})
    text_column: str | None = field(default=None, metadata={
        "help": "Text column (default: the first of text, sentence, content)."})
    label_column: str | None = field(default=None, metadata={
        "help": "Label column, the control codes (default: the first of labels, label). String labels become a "
                "ClassLabel."})
    class_names: list[str] | None = field(default=None, metadata={
        "help": "The labels (control codes), in id order: declared rather than read off the private rows (without it "
                "string labels are encoded with the sorted set present, which the synthetic data then publishes)."})
    max_length: int = field(default=64, metadata={"help": "Tokens per training row (control code included)."})
    tokenizer_vocab_size: int = field(default=1024, metadata={"help": "Vocabulary of a locally trained tokenizer."})
    n_per_label: int = field(default=50, metadata={"help": "Synthetic rows sampled per label."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=0.9, metadata={"help": "Nucleus sampling: keep the smallest token set of this mass."})
    max_new_tokens: int = field(default=48, metadata={"help": "Length of a synthetic row, in tokens (at most)."})
    generation_batch_size: int = field(default=32, metadata={"help": "Rows sampled per batch."})
    generation_seed: int = field(default=0, metadata={
        "help": "Seed of the sampling (post-processing of the DP model: it needs no secrecy)."})
    synthetic_dir: str | None = field(default=None, metadata={"help": "Where the dataset goes (OUTPUT_DIR/synthetic)."})
    hub_dataset_id: str | None = field(default=None, metadata={
        "help": "Dataset repository for --push_to_hub (default: --hub_model_id, else the output folder's name)."})
    public_epochs: float = field(default=10, metadata={"help": "Epochs of the non-private public pre-training."})
    lora_r: int = field(default=0, metadata={
        "help": "LoRA rank: > 0 trains LoRA adapters (peft) under DP instead of the --trainable_blocks scope."})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "Comma-separated layer names for LoRA (default: peft's choice for the architecture)."})


ARGUMENT_TYPES = (SynthArguments, DPTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics with `synthetic_dir` and `synthetic_rows`."""
    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)
    repo_id = None
    if push:  # the dataset repository: login and write access before any work
        from hf_dp_repr.hub.push import check_hub_access

        repo_id = check_hub_access(margs.hub_dataset_id or targs.hub_model_id)
    if targs.privacy_unit != "row":
        raise RecipeArgumentError(f"--privacy_unit {targs.privacy_unit}: the synthetic-text recipe trains one row "
                                  "(a labelled paragraph) per unit; use 'row'.")
    private, test, public, data_notes = load_labelled(margs, targs.seed)
    names = private.features["labels"].names
    name = margs.model_name_or_path
    tokenizer = _tokenizer(margs, public)
    model = lm._load_model(name, tokenizer, margs.max_length, targs.seed)
    train = padded_rows(control_rows(private), tokenizer, margs.max_length)
    evals = padded_rows(control_rows(test), tokenizer, margs.max_length)
    checks.check_before_work(model, train, targs)
    if public is not None and ru.is_tiny(name):
        save_dir = margs.public_model_dir or os.path.join(targs.output_dir, "public_pretrained")
        signature = dict(model=name, dataset=ru.dataset_name(margs) or margs.train_file, seed=targs.seed,
                         epochs=margs.public_epochs,
                         lr=margs.public_learning_rate, batch=margs.public_batch_size, block=margs.max_length,
                         vocab=len(tokenizer), recipe="synth")
        path = ru.pretrain_on_public(model, padded_rows(public, tokenizer, margs.max_length), save_dir=save_dir,
                                     training_args=targs, epochs=margs.public_epochs,
                                     learning_rate=margs.public_learning_rate, batch_size=margs.public_batch_size,
                                     signature=signature, log=logger.info)
        model = type(model).from_pretrained(path)
    card_info = ModelCardInfo(
        model_name=f"{name} fine-tuned on {ru.data_description(margs)} with control codes (DP synthetic text)",
        base_model=None if ru.is_tiny(name) else name,
        private_data=f"{len(private)} labelled rows of the '{margs.train_split}' split of "
                     f"{ru.data_description(margs)}, each as '<label>: <text>'; one row is one unit of privacy"
                     + "".join(f"; {note}" for note in data_notes),
        public_data=(f"{len(public)} docstring paragraphs of stdlib modules that are not labels, for non-private "
                     "pre-training and the tokenizer" if public is not None else f"the pre-trained weights of {name}"))
    trainer = DPTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evals, processing_class=tokenizer,
                        model_card_info=card_info, peft_config=_lora(margs))
    trainer.plan_notes = recipe_report.plan_notes(data_notes)
    metrics = ru.finish_run(trainer, ru.train(trainer, margs.overwrite_output_dir), margs,
                            extra_metrics=lm._perplexity)
    if not trainer.is_world_process_zero():
        return metrics
    synthetic = generate_synthetic(trainer.model, tokenizer, names, margs.n_per_label,
                                   temperature=margs.temperature, top_p=margs.top_p,
                                   max_new_tokens=margs.max_new_tokens, batch_size=margs.generation_batch_size,
                                   seed=margs.generation_seed, progress=not targs.disable_tqdm)
    folder = save_synthetic(synthetic, margs.synthetic_dir or os.path.join(targs.output_dir, "synthetic"),
                            trainer.ledger.to_dict(), dict(
                                model=card_info.model_name, private_data=card_info.private_data,
                                n_per_label=margs.n_per_label, temperature=margs.temperature, top_p=margs.top_p,
                                max_new_tokens=margs.max_new_tokens, seed=margs.generation_seed))
    print(f"synthetic dataset: {synthetic.num_rows} rows ({margs.n_per_label} per label) in {folder}", flush=True)
    if push:
        from hf_dp_repr.hub.dataset_push import push_synthetic_dataset

        info = push_synthetic_dataset(folder, repo_id, private=targs.hub_private_repo)
        print(f"pushed the synthetic dataset to {getattr(info, 'commit_url', info)}", flush=True)
    return {**metrics, "synthetic_dir": str(folder), "synthetic_rows": synthetic.num_rows}


def load_labelled(margs: SynthArguments, seed: int):
    """(private train split, held-out test split, public texts or None, notes for the card), the text in `text` and
    the labels a ClassLabel in `labels`. For stdlib-topics the public texts are the docstring paragraphs of the stdlib
    modules that are not among its labels (disjoint from every labelled row)."""
    if embedded_name(ru.dataset_name(margs) or "") == STDLIB_TOPICS:
        topics = load_embedded(STDLIB_TOPICS)
        labels = set(topics["train"].features["labels"].names)
        public = [" ".join(p.split()) for module, doc in stdlib_docstrings() if module not in labels
                  and module in STDLIB_MODULES for p in doc.split("\n\n") if len(p.strip()) >= 40]
        return topics["train"], topics["test"], public, []
    raw = ru.load_raw(margs)
    columns = next(iter(raw.values())).column_names
    text_col = check_column(columns, margs.text_column, ("text", "sentence", "content"), "--text_column")
    label_col = check_column(columns, margs.label_column, ("labels", "label"), "--label_column")
    labels = encode_labels(raw, label_col, margs.class_names)
    raw = labels.data.select_columns([text_col, label_col])
    raw = raw.rename_columns({k: v for k, v in ((text_col, "text"), (label_col, "labels")) if k != v})
    train, test, held_out = ru.pick_splits(raw, margs, seed)
    return train, test, None, [n for n in (labels.note, held_out) if n]


def _lora(margs: SynthArguments):
    if margs.lora_r <= 0:
        return None
    from peft import LoraConfig

    targets = margs.lora_target_modules.split(",") if margs.lora_target_modules else None
    return LoraConfig(r=margs.lora_r, lora_alpha=2 * margs.lora_r, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")


def _tokenizer(margs: SynthArguments, public):
    if not ru.is_tiny(margs.model_name_or_path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(margs.model_name_or_path)
    if public is None:
        raise RecipeArgumentError("a tiny model needs a tokenizer trained on public text, and this dataset has none: "
                                  "give --model_name_or_path a pre-trained model with its tokenizer.")
    return train_tokenizer(public, margs.tokenizer_vocab_size)


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("synth"))  # as recipes/*.py
