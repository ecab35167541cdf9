"""Push a DP synthetic dataset (`hf_dp_repr.synth.save_synthetic`'s folder) to a dataset repository, through an
allow-list as every model push: the rows sampled from the DP model, its card, the model's ledger and the record
of how the rows were sampled. Nothing else in the folder is sent (no subfolder, no hidden file, no private rows);
a folder without its ledger, or whose sampling record shows a prompt that is not a control code, is refused.

Example (no network: what would be uploaded):
    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for name in ("synthetic.parquet", "README.md", "privacy_ledger.json", "train.parquet", "notes.txt"):
    ...     _ = (d / name).write_text("{}")
    >>> _ = (d / "synthesis.json").write_text(json.dumps({"label_names": ["a"], "prompts": ["a:"]}))
    >>> dataset_files_to_push(d)
    ['README.md', 'privacy_ledger.json', 'synthesis.json', 'synthetic.parquet']
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

from ..data.control_codes import control_prompt
from ..errors import DataError, LedgerError
from ..privacy.ledger import LEDGER_FILE
from .card import CARD_FILE
from .dataset_card import DATA_FILE
from .push import IGNORE_PATTERNS, check_hub_access, create_repo, explained_hub_errors

SYNTHESIS_FILE = "synthesis.json"
DATASET_ALLOW_PATTERNS = [DATA_FILE, CARD_FILE, LEDGER_FILE, SYNTHESIS_FILE]


def dataset_files_to_push(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` (top level only) that a dataset push uploads, sorted."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
    return [n for n in names if n in DATASET_ALLOW_PATTERNS
            and not any(fnmatch.fnmatchcase(n, i) for i in IGNORE_PATTERNS)]


def check_dataset_pushable(folder: str | os.PathLike) -> None:
    """Refuse a folder without the rows, the card or a readable ledger, or whose prompts are not the control codes."""
    folder = Path(folder)
    for name in (DATA_FILE, CARD_FILE, LEDGER_FILE, SYNTHESIS_FILE):
        if not (folder / name).is_file():
            raise (LedgerError if name == LEDGER_FILE else DataError)(
                f"push: {folder} has no {name}; push a folder written by hf_dp_repr.synth.save_synthetic (a synthetic "
                "dataset is never pushed without the ledger of the model that sampled it).")
    try:
        json.loads((folder / LEDGER_FILE).read_text())
        record = json.loads((folder / SYNTHESIS_FILE).read_text())
    except ValueError as err:
        raise LedgerError(f"push: {folder} holds invalid JSON ({err}).") from None
    expected = [control_prompt(code) for code in record.get("label_names", [])]
    if record.get("prompts") != expected:
        raise DataError(f"push: {folder / SYNTHESIS_FILE} records prompts {record.get('prompts')!r}, not the control "
                        f"codes {expected!r}: rows sampled from other prompts may carry text that is not covered.")


def push_synthetic_dataset(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                           revision: str | None = None, token: str | None = None,
                           commit_message: str = "DP synthetic text (hf-dp-repr)"):
    """Upload the allow-listed files of `folder` to the dataset repository `repo_id` (created if missing); every
    check (files, ledger, prompts, login and write access) comes before anything is sent."""
    from huggingface_hub import HfApi

    check_dataset_pushable(folder)
    repo_id = check_hub_access(repo_id, token)
    repo_id = create_repo(repo_id, private=private, token=token, repo_type="dataset")
    with explained_hub_errors(f"push to {repo_id}"):
        return HfApi(token=token).upload_folder(
            repo_id=repo_id, repo_type="dataset", folder_path=str(folder), commit_message=commit_message,
            revision=revision, allow_patterns=DATASET_ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
