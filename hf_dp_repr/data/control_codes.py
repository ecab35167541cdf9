"""Control codes: each private row is trained as "<label>: <text>", and generation is prompted by "<label>:".

The prompts are built from the label NAMES only (public: the schema of the data, not its content), so nothing of a
private row can reach a prompt except through the DP model.

Example:
    >>> control_prompt("logging")
    'logging:'
    >>> from datasets import ClassLabel, Dataset, Features, Value
    >>> ds = Dataset.from_dict({"text": ["Log a message."], "labels": [0]},
    ...                        features=Features({"text": Value("string"), "labels": ClassLabel(names=["logging"])}))
    >>> control_rows(ds)
    ['logging: Log a message.']
"""

from __future__ import annotations

from ..errors import DataError

CONTROL_FORMAT = "{code}: {text}"


def control_prompt(code: str) -> str:
    """The prompt that asks the model for a row of class `code` (built from the code alone)."""
    return CONTROL_FORMAT.format(code=code, text="").rstrip()


def control_rows(dataset, text_column: str = "text", label_column: str = "labels") -> list[str]:
    """Each row of `dataset` as "<label name>: <text>" (its label a `ClassLabel`, whose names are the codes)."""
    feature = dataset.features.get(label_column)
    names = getattr(feature, "names", None)
    if not names:
        raise DataError(f"control codes: the column {label_column!r} must be a ClassLabel with names (the control "
                        "codes are the label names); cast it with dataset.cast_column(..., ClassLabel(names=[...])).")
    bad = [n for n in names if not n or ":" in n or "\n" in n]
    if bad:
        raise DataError(f"control codes: label names {bad} cannot be codes (empty, or holding ':' or a newline).")
    return [CONTROL_FORMAT.format(code=names[y], text=" ".join(t.split()))
            for t, y in zip(dataset[text_column], dataset[label_column])]
