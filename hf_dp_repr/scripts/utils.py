"""What the recipes share: argument parsing with `--config file.yaml`, models by Hub name / local path / tiny
config name, the public → private split with non-private public pre-training, and the end
of a run (evaluate, save, model card, push, result table). What is checked before any work: `recipe_checks.py`;
what is shown during and after a run: `recipe_report.py`.

The recipes (`recipes/*.py`, `hf-dp-repr train ...`) import it from the package: `from hf_dp_repr.scripts import utils`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path

from transformers import Trainer, TrainingArguments

from hf_dp_repr import tiny
from hf_dp_repr.entry_point import one_thread_for_tiny_model
from hf_dp_repr.errors import AuditDataError, RecipeArgumentError
from hf_dp_repr.scripts import recipe_report
from hf_dp_repr.scripts.arguments import given_options, parse_args
from hf_dp_repr.training.checkpoints.output_dir import check_writable

logger = logging.getLogger("hf_dp_repr.recipes")
HERE = Path(__file__).resolve().parent

# Built-in tiny configs (random init): `--model_name_or_path tiny_vit` etc.
TINY_MODELS = {name: getattr(tiny, name) for name in
               ("tiny_vit", "tiny_gpt2", "tiny_gpt2_classifier", "tiny_bert_classifier", "tiny_llama")}
PUBLIC_PRETRAINING_FILE = "public_pretraining.json"
RUN_INFO_FILE = "run_info.json"


# ---- models and metrics ----------------------------------------------------------------------------------
def is_tiny(name_or_path: str) -> bool:
    return name_or_path in TINY_MODELS


# ---- data -------------------------------------------------------------------------------------------------------
def dataset_name(margs) -> str | None:
    """The --dataset_name to load, or None when --train_file names the data (a recipe's default dataset then gives
    way; one named on the command line with --train_file too is refused by `load_raw`)."""
    name = getattr(margs, "dataset_name", None)
    if getattr(margs, "train_file", None) and "dataset_name" not in getattr(margs, "given_options", set()):
        return None
    return name


def data_description(margs) -> str:
    """What the data is called in the card and logs: the dataset name, or the training file's name."""
    return dataset_name(margs) or os.path.basename(margs.train_file)


def hub_datasets(margs) -> list[str]:
    """The Hub dataset the recipe read, for the card's metadata; [] for embedded data, local folders and files."""
    from hf_dp_repr.data import embedded_name

    name = dataset_name(margs)
    if name is None or embedded_name(name) is not None or name in getattr(margs, "BUILT_IN_DATASETS", ()):
        return []
    return [] if name.endswith(".npz") or os.path.exists(os.path.expanduser(name)) else [name]


def load_raw(margs):
    """The recipe's data as a DatasetDict, from --dataset_name or --train_file / --validation_file / --test_file
    (`hf_dp_repr.data.user_data`, the one loader of every command)."""
    from hf_dp_repr.data.user_data import load_user_data

    return load_user_data(dataset_name(margs), margs.dataset_config_name, train_file=margs.train_file,
                          validation_file=margs.validation_file, test_file=margs.test_file)


def pick_splits(raw, margs, seed: int):
    """(train, eval, note) of `raw`: the named splits, or, with no eval split, a held-out share of the training rows
    (`note` says so, for the plan and the card; None otherwise)."""
    from hf_dp_repr.data.user_data import hold_out

    return hold_out(raw, margs.train_split, margs.eval_split, margs.holdout_fraction, seed)


# ---- public → private --------------------------------------------------------------------------------------
def split_public_private(train, public_fraction: float, seed: int):
    """Disjoint (public, private) parts of `train`; `public_fraction` of the examples are public."""
    if not 0 < public_fraction < 1:
        raise RecipeArgumentError(f"--public_fraction must be in (0, 1) to split off public data, got "
                                  f"{public_fraction}")
    parts = train.train_test_split(test_size=1 - public_fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def pretrain_on_public(model, public, *, save_dir: str, training_args, epochs: float, learning_rate: float,
                       batch_size: int, signature: dict, data_collator=None, log=print) -> str:
    """Train `model` non-privately on `public` with a plain `transformers.Trainer`, `save_pretrained` it into
    `save_dir` and return `save_dir` (the caller reloads it with `from_pretrained`, as it would a Hub name).

    If `save_dir` already holds a model pre-trained with the same `signature` (model, data, split, seed,
    schedule), it is reused: runs that share a public model (the demo's ε = 1, ε = 8 and reference) train it once.
    """
    from accelerate import PartialState

    state = PartialState()
    marker = Path(save_dir) / PUBLIC_PRETRAINING_FILE
    reuse = marker.exists() and json.loads(marker.read_text()).get("signature") == signature
    state.wait_for_everyone()  # every process has decided before the main one may write the marker
    if reuse:
        log(f"public pre-training: reusing {save_dir} (same model, data, split and schedule)")
        return save_dir
    log(f"public pre-training: {len(public)} public examples, {epochs:g} epochs, non-private → {save_dir}")
    args = TrainingArguments(
        output_dir=save_dir, per_device_train_batch_size=batch_size, num_train_epochs=epochs,
        learning_rate=learning_rate, seed=training_args.seed, report_to="none", save_strategy="no",
        logging_strategy="epoch", disable_tqdm=True, use_cpu=training_args.use_cpu,
        remove_unused_columns=training_args.remove_unused_columns, dataloader_drop_last=False,
        # the same precision as the DP run: accelerate's state is set once per process and refuses a change
        fp16=training_args.fp16, bf16=training_args.bf16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=public, data_collator=data_collator,
                      callbacks=[recipe_report.ProgressLines("public pre-training", epochs, log=log)])
    trainer.remove_callback(_printer_callback())  # the progress lines say it; no dict per epoch
    result = trainer.train()
    if state.is_main_process:
        model.save_pretrained(save_dir)
        marker.write_text(json.dumps({"signature": signature, "examples": len(public),
                                      "train_loss": result.training_loss}, indent=2))
    state.wait_for_everyone()
    return save_dir


def _printer_callback():
    from transformers import PrinterCallback

    return PrinterCallback


# ---- the end of a run ------------------------------------------------------------------------------------------
def finish_run(trainer, train_result, model_args, *, push: bool = False, extra_metrics=None, extra_rows=None,
               split: dict | None = None) -> dict:
    """Evaluate, write all_results.json, save the model (weights + ledger + DP card), push if `push`, and print a
    short result table (main process).

    `extra_metrics(metrics) -> dict` adds derived metrics (e.g. perplexity from the eval loss); `extra_rows(trainer)
    -> dict` adds rows to the printed table (e.g. a sample generated by the DP model). `split`: what defines the
    private split (`run_split.split_record`), written to run_info.json (never pushed) for `hf-dp-repr audit --run`."""
    metrics = dict(train_result.metrics)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    metrics.update(extra_metrics(metrics) if callable(extra_metrics) else {})
    metrics["epsilon"] = trainer.epsilon()
    trainer.save_metrics("all", metrics, combined=False)
    trainer.save_model()  # after the metrics and the law JSON exist, so the card states them
    if trainer.is_world_process_zero():
        info = {"model_args": asdict(model_args) if is_dataclass(model_args) else model_args, "metrics": metrics,
                **({"split": split} if split else {})}
        Path(trainer.args.output_dir, RUN_INFO_FILE).write_text(json.dumps(info, indent=2, default=str))
    if push:
        from hf_dp_repr.hub.push import push_dp_model

        push_dp_model(trainer)
    # rank 0's table; on every process when sharded: the model's forward (e.g. generating a sample) is a collective
    needed = trainer.is_world_process_zero() or getattr(trainer, "sharded", False)
    extra = extra_rows(trainer) if callable(extra_rows) and needed else None
    if trainer.is_world_process_zero():
        table = recipe_report.result_table(metrics, trainer.ledger, getattr(model_args, "eval_split", "eval"), extra,
                                           public_fraction=(split or {}).get("public_fraction", 0.0))
        print(f"\n{table}\n(output: {trainer.args.output_dir})", flush=True)
    return metrics


def start_run(dataclass_types, argv: list[str] | None = None):
    """What every recipe does first: parse the arguments, set up logging, seed (so a newly initialised head is the
    same in every process and every run), and take `push_to_hub` over so the run is pushed once at the end, by
    `hf_dp_repr.hub` (DP card, allow-listed files), after checking login and write access before any work.
    Returns (model/data args, training args, push)."""
    from transformers import set_seed

    margs, targs = parse_args(dataclass_types, argv)
    check_names(margs)  # a missing folder, or a Hub name while offline: now, not after a minute of retries
    use_gguf_folder(margs)
    margs.given_options = given_options(argv)  # read by recipe_report.default_logging
    setup_logging(targs)
    if targs.should_save:
        check_writable(targs.output_dir)
    targs.resume_from_checkpoint = resume_point(targs, getattr(margs, "overwrite_output_dir", False))
    if is_tiny(getattr(margs, "model_name_or_path", "") or ""):
        one_thread_for_tiny_model()
    if targs.push_to_hub:  # login and write access now, not after training
        from hf_dp_repr.hub.push import check_hub_access

        targs.hub_model_id = check_hub_access(targs.hub_model_id or Path(targs.output_dir).resolve().name)
    set_seed(targs.seed)
    push, targs.push_to_hub = targs.push_to_hub, False
    return margs, targs, push


def check_names(margs) -> None:
    """The model and dataset names of a recipe, before any work (`data.hub_names`): the built-in tiny models, the
    shipped datasets and .npz files pass; a missing folder, or a Hub name while offline and not cached, is refused."""
    from hf_dp_repr.data import MINILM, embedded_name
    from hf_dp_repr.data.embedded import EMBEDDED_DATASETS
    from hf_dp_repr.data.gguf_models import is_gguf_model
    from hf_dp_repr.data.hub_names import check_dataset_name, check_model_name

    model = getattr(margs, "model_name_or_path", None)
    if model and not is_tiny(model) and model != MINILM and not is_gguf_model(model):  # (resolve_model_path's)
        check_model_name(model, shipped=tuple(TINY_MODELS))
    for flag in ("tokenizer_name", "image_processor", "sft_model"):  # other names that reach for the Hub
        if name := getattr(margs, flag, None):
            check_model_name(name, flag=f"--{flag}")
    dataset = getattr(margs, "dataset_name", None)
    built_here = getattr(margs, "BUILT_IN_DATASETS", ())  # names a recipe builds itself (the SFT recipe's chats)
    if dataset and embedded_name(dataset) is None and not dataset.endswith(".npz") and dataset not in built_here:
        check_dataset_name(dataset, shipped=EMBEDDED_DATASETS)
    if public := getattr(margs, "public_dataset_name", None):
        check_dataset_name(public, shipped=EMBEDDED_DATASETS, flag="--public_dataset_name")


def use_gguf_folder(margs) -> None:
    """A GGUF model's name (`smollm2-135m-instruct`, a `.gguf` path) becomes its dequantised, cached plain folder
    (`data.gguf_models`), before any work: every loader of the recipe then reads it with `from_pretrained`; what
    leaves the machine names it by its shipped name again (`hub.public_names`)."""
    from hf_dp_repr.data import resolve_model_path
    from hf_dp_repr.data.gguf_models import is_gguf_model

    name = getattr(margs, "model_name_or_path", None)
    if name and is_gguf_model(name):
        margs.model_name_or_path = resolve_model_path(name)


def resume_point(training_args, overwrite: bool) -> str | None:
    """The checkpoint a recipe resumes from, decided before any work as Hugging Face's example scripts do:
    --resume_from_checkpoint if given; else, in an --output_dir that holds checkpoints, the last complete one, unless
    --overwrite_output_dir; refused if none is complete."""
    from hf_dp_repr.scripts.checks import RecipeArgumentError
    from hf_dp_repr.training.checkpoints.output_dir import checkpoints, last_complete_checkpoint

    out = training_args.output_dir
    if training_args.resume_from_checkpoint or overwrite or not checkpoints(out):
        return training_args.resume_from_checkpoint
    path, skipped = last_complete_checkpoint(out)
    if path is None:
        raise RecipeArgumentError(f"--output_dir {out} holds checkpoints of an earlier run, none complete "
                                  f"({', '.join(skipped)}): pass --overwrite_output_dir to start afresh (they are "
                                  "deleted), or another --output_dir.")
    logger.warning("--output_dir %s holds checkpoints of an earlier run: resuming from %s, the last complete one. To "
                   "start afresh, pass --overwrite_output_dir (they are deleted) or another --output_dir.", out, path)
    return path


def train(trainer, overwrite: bool = False):
    """`trainer.train()`, resuming from the checkpoint `start_run` chose; with --overwrite_output_dir the earlier
    run's checkpoints (and its record of privacy spent) are deleted first, now that every check has passed."""
    from hf_dp_repr.training.checkpoints.output_dir import STAGING_DIR, checkpoints
    from hf_dp_repr.training.checkpoints.resume import SPENT_FILE

    out = trainer.args.output_dir
    if overwrite and trainer.args.should_save:
        for path in checkpoints(out) + [os.path.join(out, STAGING_DIR)]:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, SPENT_FILE))
    return trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)


def setup_logging(training_args) -> None:
    """INFO on the main process; on the others only errors (transformers' and ours, and Python warnings), so that
    with several processes every log line, plan table and warning appears once."""
    import transformers

    main = training_args.should_log
    level = logging.INFO if main else logging.ERROR
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    for name in ("", "hf_dp_repr"):
        logging.getLogger(name).setLevel(level)
    if not main:
        if training_args.log_level_replica == "warning":  # the Trainer sets transformers' verbosity from it
            training_args.log_level_replica = "error"
        transformers.utils.logging.set_verbosity_error()
        logging.captureWarnings(True)  # Python warnings become log records of "py.warnings": dropped here


# ---- what defines the private split (run_info.json's `split`; hf-dp-repr audit --run: scripts/run_split.py) ----
def split_record(recipe: str, source_fingerprint: str, public_fraction: float, seed: int, members: int,
                 non_members: int) -> dict:
    """The `split` entry of run_info.json: what defines the private split (`scripts/run_split.py`)."""
    return {"recipe": recipe, "public_fraction": public_fraction, "seed": seed,
            "dataset_fingerprint": source_fingerprint, "members": members, "non_members": non_members}


def arguments(cls, model_args: dict):
    """The recipe's argument dataclass `cls` from run_info.json's `model_args` (its init fields only)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in model_args.items() if k in names})


def check_source(fingerprint: str, record: dict, dataset_name: str) -> None:
    """Refuse a reloaded dataset that is not the one the run split (another revision, other files)."""
    if fingerprint != record["dataset_fingerprint"]:
        raise AuditDataError(
            f"the dataset {dataset_name!r} reloads with fingerprint {fingerprint}, but the run split one with "
            f"fingerprint {record['dataset_fingerprint']} (run_info.json): it changed since (another revision or "
            "other files), so its members cannot be rebuilt. Pass --members and --non-members yourself.")
