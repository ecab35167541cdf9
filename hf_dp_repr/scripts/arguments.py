"""What every recipe parses: the script arguments they share (one base dataclass, `ScriptArguments`, and the
public pre-training ones, `PublicPretrainingArguments`), and `parse_args`, HfArgumentParser with `--config file.yaml`.

    >>> from hf_dp_repr import DPTrainingArguments
    >>> from hf_dp_repr.scripts.arguments import ScriptArguments, parse_args
    >>> script, train = parse_args((ScriptArguments, DPTrainingArguments),
    ...                            ["--dataset_name", "digits", "--output_dir", "out", "--target_epsilon", "1"])
    >>> script.dataset_name, script.train_split, train.target_epsilon
    ('digits', 'train', 1.0)
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import yaml
from transformers import HfArgumentParser

from hf_dp_repr.entry_point import did_you_mean, option_strings
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.scripts.runner import PROG
from hf_dp_repr.scripts.usage import usage_text


# ---- arguments the recipes share -------------------------------------------------------------------------
@dataclass
class ScriptArguments:
    """Model and data arguments of every recipe; each recipe subclasses it (its own defaults and fields)."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub name, local folder (save_pretrained), or built-in tiny config."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "An embedded dataset, a DatasetDict.save_to_disk folder, or a datasets.load_dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: str | None = field(default=None, metadata={
        "help": "A csv/tsv, json/jsonl, parquet, arrow or txt file of training rows, instead of --dataset_name "
                "(docs/your-data.md)."})
    validation_file: str | None = field(default=None, metadata={"help": "A data file of validation rows."})
    test_file: str | None = field(default=None, metadata={"help": "A data file of test rows (evaluated on)."})
    holdout_fraction: float = field(default=0.2, metadata={
        "help": "When the data has no --eval_split (nor a validation split), hold out this share of the training "
                "rows for evaluation (with --seed); the plan and the model card say so."})
    train_split: str = field(default="train", metadata={"help": "Split trained on (the private data)."})
    eval_split: str = field(default="test", metadata={"help": "Split evaluated on (held out)."})
    config: str | None = field(default=None, metadata={
        "help": "YAML file of arguments (recipes/configs/*.yaml); command-line arguments override it."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start afresh in an --output_dir that holds checkpoints of an earlier run (they are deleted when "
                "training starts). Default: resume from the last complete one, as Hugging Face's example scripts do; "
                "--resume_from_checkpoint names another."})


@dataclass
class DefaultsArguments:
    """The switch of the DP-aware defaults (`hf_dp_repr.scripts.dp_defaults`)."""

    dp_defaults: Literal["on", "off"] = field(default="on", metadata={
        "help": "on: the training hyperparameters you do not give (scope, expected batch, epochs, optimizer, learning "
                "rate, clipping) are chosen from n, ε and the model by hf_dp_repr/scripts/dp_defaults.py, and the plan "
                "says why; each option you give replaces its own value only. off: the library's and the Trainer's own "
                "defaults (every parameter trains: full fine-tuning, learning rate 5e-5, batch 8)."})


@dataclass
class LoraArguments:
    """LoRA adapters of the language recipes (peft)."""

    use_lora: bool | None = field(default=None, metadata={
        "help": "Train LoRA adapters (peft) instead of every weight. Default: chosen by the DP-aware defaults "
                "(adapters for a pretrained model of at least 100 M parameters when peft is installed, else every "
                "weight); with --dp_defaults off the recipe's own (sft, dpo: true; lm: false)."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling α."})
    lora_target_modules: str = field(default="q_proj,v_proj", metadata={
        "help": "Comma-separated module names, or 'all-linear' (the LM head excluded)."})

    def lora_config(self, default: bool):
        """The LoRA adapters (`--use_lora`, or `default` when it was left unset), or None for every weight."""
        if not (self.use_lora if self.use_lora is not None else default):
            return None
        from peft import LoraConfig

        targets = self.lora_target_modules
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=targets if targets == "all-linear" else targets.split(","))


@dataclass
class ClassificationArguments(DefaultsArguments, ScriptArguments):
    """`ScriptArguments` + the label set and eval size of a classifier's recipe."""

    label_column: str | None = field(default=None, metadata={
        "help": "Label column (default: the first of labels, label, fine_label). String labels become a ClassLabel."})
    class_names: list[str] | None = field(default=None, metadata={
        "help": "The classes, in id order, e.g. negative positive (the Trainer's own --label_names names input keys): "
                "declared rather than read off the private rows "
                "(without it, string labels are encoded with the sorted set of labels present, which the model then "
                "publishes; the plan and the card say so)."})
    num_labels: int | None = field(default=None, metadata={
        "help": "Number of classes (labels 0..N-1), when neither the dataset (a ClassLabel column, a .npz with "
                "class_names) nor the model (a saved classifier) declares them. Never read off the private labels."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many examples."})


@dataclass
class PublicPretrainingArguments:
    """Non-private pre-training on a public share of the training split, before DP fine-tuning on the rest."""

    public_fraction: float | None = field(default=None, metadata={
        "help": "Share of the training split used as PUBLIC data: the model is first trained on it non-privately, "
                "then DP fine-tuned on the disjoint rest. Default: 0 (no public data), except 0.5 for a tiny config "
                "(no pretrained weights) on the embedded default data; a tiny config on your own data needs it."})
    public_epochs: float = field(default=40, metadata={"help": "Epochs of the non-private public pre-training."})
    public_learning_rate: float = field(default=3e-3, metadata={"help": "Learning rate of the public pre-training."})
    public_batch_size: int = field(default=32, metadata={"help": "Batch size of the public pre-training."})
    public_shift: str = field(default="none", metadata={
        "help": "A fixed map applied to the public images only, so that public pre-training sees another distribution "
                "than the private task (the usual case: pre-trained elsewhere, fine-tuned on your data): none, "
                "rotate90, mirror, invert, blur (hf_dp_repr.data.images.PUBLIC_SHIFTS)."})
    public_classes: list[int] | None = field(default=None, metadata={
        "help": "Keep only the public examples of these classes (label ids), e.g. 0 1 2 3 4: public pre-training "
                "on another task than the private one (default: every class)."})
    public_model_dir: str | None = field(default=None, metadata={
        "help": "Where the publicly pre-trained model is saved (default: <output_dir>/public_pretrained); reused "
                "when it holds a model pre-trained with the same settings."})

    def resolved_public_fraction(self, tiny: bool, embedded: bool, model: str = "") -> float:
        """`public_fraction`, or its default: 0.5 for a randomly initialised tiny config on the embedded default data
        (the offline demo), else 0. A tiny config on the user's own data without `--public_fraction` is refused: part
        of their dataset is never taken as public (trained on without DP) unless they say so."""
        if self.public_fraction is not None:
            return self.public_fraction
        if tiny and not embedded:
            raise RecipeArgumentError(
                f"--model_name_or_path {model} is randomly initialised and no public data is given (no part of your "
                "dataset is used without DP unless you say so): pass a pretrained --model_name_or_path (pre-trained on "
                "a public dataset), or --public_fraction F to pre-train WITHOUT DP on that share of your training "
                "split.")
        return 0.5 if tiny else 0.0


@dataclass
class AnalysisArguments:
    """The representation laws measured on the eval split during training."""

    analyze_representations: bool = field(default=False, metadata={
        "help": "Measure the representation laws on the eval split at the start and end of training: "
                "representation_law.json + plot, ρ in the model card."})
    analysis_max_examples: int | None = field(default=None, metadata={"help": "Analyse at most this many examples."})


# ---- the --config parser -------------------------------------------------------------------------------
def parse_args(dataclass_types, argv: list[str] | None = None):
    """Parse `argv` (default: sys.argv[1:]) into `dataclass_types` with HfArgumentParser.

    `--config file.yaml` (a flat mapping of argument names to values) is expanded in place, before the other
    command-line arguments, so anything given on the command line overrides the file. An unknown option, or an
    abbreviated one, is refused (RecipeArgumentError, naming the closest valid one) before the arguments are
    checked. `-h` / `--help` print the usage with the DP arguments first; `--help-all` with every Trainer argument's
    help.
    """
    config, rest = expand_argv(argv)
    prog = PROG.get() or os.path.basename(sys.argv[0])
    if {"-h", "--help", "--help-all"} & set(rest):  # DP arguments first (scripts/usage.py)
        print(usage_text(dataclass_types, prog, full="--help-all" in rest), end="")
        raise SystemExit(0)
    parser = HfArgumentParser(dataclass_types, prog=prog, allow_abbrev=False)  # --target_epsilo: refused
    unknown = [a.split("=", 1)[0] for a in parser.parse_known_args(rest)[1] if a.startswith("-")]
    if unknown:  # before the dataclasses' own checks, which would complain about what the typo left unset
        valid = option_strings(parser)
        raise RecipeArgumentError("; ".join(f"unrecognized argument {a}{did_you_mean(a, valid)}" for a in unknown))
    out = parser.parse_args_into_dataclasses(args=rest)
    for obj in out:
        if hasattr(obj, "config"):
            obj.config = config
    return out


def expand_argv(argv: list[str] | None = None) -> tuple[str | None, list[str]]:
    """(the --config file or None, the arguments with the file's expanded in front of the command line's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    return known.config, (yaml_to_argv(known.config) + rest if known.config else rest)


def given_options(argv: list[str] | None = None) -> set[str]:
    """Names of the options set on the command line or in the --config file (so a recipe can tell a default apart)."""
    return {a[2:].split("=", 1)[0] for a in expand_argv(argv)[1] if a.startswith("--")}


def yaml_to_argv(path: str) -> list[str]:
    """`{lr: 0.01, report_to: [none], fp16: false}` → `["--lr", "0.01", "--report_to", "none", "--fp16", "False"]`."""
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise RecipeArgumentError(f"--config {path}: expected a mapping of argument names to values, got "
                                  f"{type(values).__name__}")
    argv: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        argv.append(f"--{key}")
        argv.extend(str(v) for v in value) if isinstance(value, list) else argv.append(str(value))
    return argv
