"""The datasets an audit from the command line reads (`hf-dp-repr audit`, `hf-dp-repr audit canaries`): loaded from
a spec (`digits:train|test`, or a `save_to_disk` folder as `DIR[:split]`), with their labels checked against the
model and a hash of each example's inputs (to refuse an example on both sides); and the training arguments the
audits that train (`audit canaries`, `audit exposure`) read after `--` (`training_flags`). A refusal exits with the
message, before anything is written.

Example:
    >>> train = load_audit_dataset("digits:train", "--members")
    >>> len(train), len(fingerprints(train.select(range(10))))
    (1437, 10)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .mia import MODEL_INPUTS


def fail(message: str):
    raise SystemExit(f"hf-dp-repr audit: {message}")


def load_audit_dataset(spec, flag: str):
    """`digits:train|test` or `DIR[:split]` (save_to_disk) → a Dataset with `labels`; a Dataset is checked as is."""
    import datasets

    if isinstance(spec, datasets.Dataset):
        data, spec = spec, f"(rebuilt, {len(spec)} rows)"
    elif spec.startswith("digits:"):
        from ..data import load_digits_dataset

        split = spec.split(":", 1)[1]
        data = load_digits_dataset()
        if split not in data:
            fail(f"{flag} {spec}: digits has splits {sorted(data)}")
        data = data[split]
    else:
        path, _, split = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
        if not Path(path).exists():
            fail(f"{flag} {spec}: no such directory (give a save_to_disk folder, DIR:split, or digits:train|test)")
        try:
            data = datasets.load_from_disk(path)
        except IndexError:  # datasets cannot load a folder saved from an empty Dataset
            fail(f"{flag} {spec} is empty (datasets cannot even load it). Nothing written.")
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                fail(f"{flag} {spec}: a DatasetDict; name a split as {path}:SPLIT, one of {sorted(data)}")
            data = data[split]
    if "label" in data.column_names and "labels" not in data.column_names:
        data = data.rename_column("label", "labels")
    if len(data) == 0:
        fail(f"{flag} {spec} is empty. Nothing written.")
    if "labels" not in data.column_names or not any(c in data.column_names for c in MODEL_INPUTS[:2]):
        fail(f"{flag} {spec}: needs a `labels` (or `label`) column and `pixel_values` or `input_ids`; has "
              f"{data.column_names}")
    return data


def fingerprints(data) -> set[str]:
    """A hash of each example's inputs (labels left out: a relabelled copy is still the same example)."""
    cols = [c for c in MODEL_INPUTS if c in data.column_names]
    rows = data.with_format("numpy")
    out = set()
    for start in range(0, len(rows), 512):
        batch = rows[start:start + 512]
        for i in range(len(batch["labels"])):
            h = hashlib.sha256()
            for c in cols:
                h.update(np.ascontiguousarray(np.asarray(batch[c][i])).tobytes())
            out.add(h.hexdigest())
    return out


def check_labels(data, flag: str, num_labels: int) -> None:
    """Refuse labels outside the model's 0..num_labels-1."""
    labels = np.asarray(data.with_format("numpy")[:]["labels"])
    if labels.min() < 0 or labels.max() >= num_labels:
        fail(f"{flag}: labels in {labels.min()}..{labels.max()}, outside the model's 0..{num_labels - 1}. "
              "Nothing written.")


def training_flags(flags: list[str], output_dir: str, defaults: list[str], refuse, *, missing: str,
                   refused: tuple[str, ...], why: str):
    """The `DPTrainingArguments` an audit command trains with, from its flags after `--`: `defaults` first (the
    flags given win), `output_dir` last. `refuse(message)` is the command's own refusal (it exits before anything is
    written): with `missing` when no flag is given, naming the `refused` flags with `why` when one of them is given
    (as `--flag` or `--flag=value`), and with DPTrainingArguments' own message for a value it refuses.

    Example:
        >>> def refuse(message): raise SystemExit(message)
        >>> training_flags(["--", "--target_epsilon", "1", "--output_dir", "x"], "out", [], refuse, missing="",
        ...                refused=("--output_dir",), why="the run goes to --out.")
        Traceback (most recent call last):
        SystemExit: --output_dir: the run goes to --out.
    """
    from transformers import HfArgumentParser

    from ..training.arguments import DPTrainingArguments

    flags = flags[1:] if flags[:1] == ["--"] else flags
    if not flags:
        refuse(missing)
    if any(flag.split("=", 1)[0] in refused for flag in flags):
        refuse(f"{' / '.join(refused)}: {why}")
    try:
        args, = HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses(
            [*defaults, *flags, "--output_dir", output_dir])
    except ValueError as err:
        refuse(f"training arguments: {err}")
    return args
