"""A user's own data, as Hugging Face's example scripts take it, in ONE place for every command that reads data
(`hf-dp-repr train image|text|lm|sft|dpo`, `synth`, `analyze`, and `audit --run` through the recipes):

- `--dataset_name`: a Hub name (`datasets.load_dataset`), a `save_to_disk` folder, a folder of data files (an
  imagefolder; csv/tsv, json/jsonl, parquet, arrow or txt files, detected as `load_dataset` does, but a folder
  mixing two formats is refused instead of silently reading one), or one data file;
- `--train_file` / `--validation_file` / `--test_file`: data files of one format;
- `--text_column`, `--label_column`, `--image_column`, checked against the columns present;
- `--class_names`: the set of classes. It is schema, not data: taken from `--class_names` or the dataset's declared
  `ClassLabel`; string labels with neither are encoded with the sorted set of the labels present, which is then
  read off the private rows and published with the model (`LabelSet.read_off_rows`, said in the plan and the card);
- a missing evaluation split is held out from the training data (`hold_out`), said in the plan and the card.

A bad input is refused before any work with a typed one-line error (`DataError`, `RecipeArgumentError`).

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "train.csv").write_text("text,category\\nhello there,greeting\\nbye now,farewell\\n")
    >>> raw = load_user_data(folder / "train.csv")
    >>> labels = encode_labels(raw, "category")
    >>> labels.names, labels.read_off_rows, raw_labels(labels.data["train"], "category")
    (['farewell', 'greeting'], True, [1, 0])
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError, RecipeArgumentError

logger = logging.getLogger(__name__)

# file extension → the datasets builder that reads it (as load_dataset detects it)
FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                ".arrow": "arrow", ".txt": "text"}
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
SPLIT_FLAGS = {"train": "--train_file", "validation": "--validation_file", "test": "--test_file"}


def data_format(path: str | os.PathLike, flag: str = "--train_file") -> str:
    """The `datasets` builder for a data file (`csv`, `json`, `parquet`, `arrow`, `text`), or a DataError."""
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_FORMATS:
        raise DataError(f"{flag} {path}: unknown data file format {suffix or '(no extension)'!r}; use one of "
                        f"{', '.join(sorted(FILE_FORMATS))}")
    return FILE_FORMATS[suffix]


def load_files(files: dict[str, str | os.PathLike]):
    """A DatasetDict from `{split: file}`: every file must exist and be of one format."""
    import datasets

    formats = {}
    for split, path in files.items():
        flag = SPLIT_FLAGS.get(split, "--dataset_name")
        if not Path(path).is_file():
            raise DataError(f"{flag} {path}: no such file ({os.path.abspath(path)})")
        formats[split] = data_format(path, flag)
    if len(set(formats.values())) > 1:
        raise DataError(f"the data files are of different formats ({formats}); give files of one format")
    fmt = next(iter(formats.values()))
    kwargs = {"delimiter": "\t"} if all(Path(p).suffix.lower() == ".tsv" for p in files.values()) else {}
    return datasets.load_dataset(fmt, data_files={k: str(v) for k, v in files.items()}, **kwargs)


def folder_format(folder: Path) -> str | None:
    """'imagefolder' for a folder of images, the data file format of a folder of data files, or a DataError for a
    folder that mixes formats (load_dataset would read the most common one and drop the others) or has no data."""
    found = Counter()
    for path in folder.rglob("*"):
        if not path.is_file() or path.name.startswith("."):
            continue
        suffix = path.suffix.lower()
        if suffix in IMAGE_EXTENSIONS:
            found["imagefolder"] += 1
        elif suffix in FILE_FORMATS and not path.stem == "metadata":  # an imagefolder's metadata.csv / .jsonl
            found[FILE_FORMATS[suffix]] += 1
    if not found:
        raise DataError(f"--dataset_name {folder}: no data files in this folder (images, or "
                        f"{', '.join(sorted(FILE_FORMATS))} files)")
    if len(found) > 1:
        raise DataError(f"--dataset_name {folder}: ambiguous format, the folder holds {dict(sorted(found.items()))} "
                        "files; keep one format in it, or name the files with --train_file / --validation_file / "
                        "--test_file")
    return next(iter(found))


def load_user_data(dataset_name: str | os.PathLike | None = None, config_name: str | None = None, *,
                   train_file: str | None = None, validation_file: str | None = None, test_file: str | None = None):
    """A `DatasetDict` from a Hub name, a `save_to_disk` folder, a folder or file of data, or split files."""
    import datasets

    files = {s: f for s, f in (("train", train_file), ("validation", validation_file), ("test", test_file)) if f}
    if files:
        if dataset_name is not None:
            raise RecipeArgumentError(f"--dataset_name {dataset_name} and --train_file/--validation_file/--test_file "
                                      "both name the data; give one.")
        if "train" not in files:
            raise RecipeArgumentError("--validation_file / --test_file without --train_file: give --train_file.")
        return load_files(files)
    if dataset_name is None:
        raise RecipeArgumentError("no data: give --dataset_name or --train_file.")
    path = Path(os.path.expanduser(str(dataset_name)))
    if path.is_file():
        return load_files({"train": path})
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            data = datasets.load_from_disk(str(path))
            return data if isinstance(data, datasets.DatasetDict) else datasets.DatasetDict(train=data)
        if folder_format(path) == "imagefolder":
            return datasets.load_dataset("imagefolder", data_dir=str(path))
        return datasets.load_dataset(str(path))  # its splits from the file names, as load_dataset finds them
    return datasets.load_dataset(str(dataset_name), config_name)


def check_column(columns, name: str | None, candidates, flag: str) -> str:
    """`name` if it is one of `columns`, else the first of `candidates` present; a DataError naming the columns."""
    columns = list(columns)
    if name is not None:
        if name not in columns:
            raise DataError(f"{flag} {name!r}: no such column; the columns are {columns}")
        return name
    for c in candidates:
        if c in columns:
            return c
    raise DataError(f"none of the columns {columns} is one of {list(candidates)}; name it with {flag}")


# ---- splits -----------------------------------------------------------------------------------------------------
def hold_out(raw, train_split: str, eval_split: str, fraction: float, seed: int):
    """(train, eval, note): the named splits; when `eval_split` is missing (and the dataset has no `validation`
    split to use instead), `fraction` of the training rows held out with `seed`, and a note saying so."""
    if train_split not in raw:
        raise RecipeArgumentError(f"the data has no split {train_split!r} (it has {list(raw)}); set --train_split.")
    if eval_split in raw:
        return raw[train_split], raw[eval_split], None
    if eval_split == "test" and "validation" in raw:
        return raw[train_split], raw["validation"], f"evaluated on the 'validation' split (no '{eval_split}' split)"
    if not 0 < fraction < 1:
        raise RecipeArgumentError(f"the data has no split {eval_split!r} (it has {list(raw)}) and --holdout_fraction "
                                  f"{fraction} holds nothing out; give --test_file or --eval_split, or a fraction "
                                  "in (0, 1).")
    parts = raw[train_split].train_test_split(test_size=fraction, seed=seed, shuffle=True)
    note = (f"no '{eval_split}' split: {len(parts['test'])} of the {len(raw[train_split])} training rows "
            f"({fraction:.0%}, seed {seed}) held out for evaluation, not trained on")
    return parts["train"], parts["test"], note


# ---- label sets ---------------------------------------------------------------------------------------------------
@dataclass
class LabelSet:
    """The data with its label column a `ClassLabel`, the class names (None: integer labels with no declared
    names, left to `--num_labels`), and whether the names were read off the (private) rows."""

    data: object
    names: list[str] | None
    read_off_rows: bool = False

    @property
    def note(self) -> str | None:
        """What the plan and the card say when the label set was read off the private rows."""
        if not self.read_off_rows:
            return None
        return (f"the label set ({len(self.names)} classes: {', '.join(self.names[:5])}"
                f"{', ...' if len(self.names) > 5 else ''}) was read off the training rows and is published with the "
                "model (id2label); declare it with --class_names to keep it out of the data")


def raw_labels(split, column: str) -> list:
    return list(split.with_format(None)[column])


def encode_labels(raw, column: str, class_names: list[str] | None = None) -> LabelSet:
    """Cast `column` of every split of `raw` (a DatasetDict) to a `ClassLabel`: the dataset's own, `class_names`, or
    (string labels, neither given) the sorted labels present in the data, flagged `read_off_rows`."""
    import datasets

    splits = list(raw.values())
    feature = splits[0].features.get(column)
    declared = getattr(feature, "names", None)
    if declared:
        if class_names and list(class_names) != list(declared):
            raise RecipeArgumentError(f"--class_names {class_names}, but the dataset declares the classes {declared} "
                                      f"in column {column!r}; drop --class_names.")
        return LabelSet(raw, list(declared))
    strings = getattr(feature, "dtype", None) in ("string", "large_string")
    if not strings and not class_names:
        return LabelSet(raw, None)  # integer labels, no names: --num_labels declares them (checks.class_names)
    read_off = class_names is None
    names = list(class_names) if class_names else sorted({str(v) for s in splits for v in raw_labels(s, column)})
    if strings:
        index = {name: i for i, name in enumerate(names)}
        unknown = sorted({v for s in splits for v in raw_labels(s, column)} - set(index))
        if unknown:
            raise DataError(f"column {column!r} holds labels not in --class_names: {unknown[:5]}; add them to "
                            f"--class_names (now {names})")
        raw = raw.map(lambda b: {column: [index[v] for v in b[column]]}, batched=True)
    else:
        bad = sorted({int(v) for s in splits for v in raw_labels(s, column)} - set(range(len(names))))
        if bad:
            raise DataError(f"column {column!r} holds labels {bad[:5]} outside the {len(names)} --class_names "
                            f"(0..{len(names) - 1})")
    raw = raw.cast_column(column, datasets.ClassLabel(names=names))
    return LabelSet(raw, names, read_off_rows=read_off)  # its note: for the plan (recipes) or the log (analyze)


# ---- units of privacy ------------------------------------------------------------------------------------------------
USER_WORDS = re.compile(r"(^|_)(user|author|customer|client|patient|person|member|account|sender|speaker|owner)"
                        r"(_?(id|name|key))?$", re.IGNORECASE)


def user_like_columns(columns) -> list[str]:
    """The columns whose name says they identify a person (user_id, author, customer_id, ...)."""
    return [c for c in columns if USER_WORDS.search(str(c))]


def warn_row_level_users(columns, privacy_unit: str) -> list[str]:
    """Warn when training at row level on data with a column that identifies people: one person's many rows are then
    protected only as a group of rows (ε grows with their number). Returns the columns warned about."""
    found = user_like_columns(columns) if privacy_unit == "row" else []
    if found:
        logger.warning("data: the column %r looks like it identifies people, and each row is one unit of privacy: a "
                       "person with k rows is protected with about k times the ε. Pass --privacy_unit %s to protect "
                       "each person as one unit.", found[0], found[0])
    return found
