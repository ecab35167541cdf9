"""Loading a model whose weights file is broken: name the file and the fix.

`from_pretrained` on a truncated `model.safetensors` (an interrupted download or copy) raises safetensors'
`SafetensorError: Error while deserializing header: invalid header length`, which names no file. The recipes and
`hf-dp-repr analyze` load models inside `explained_load_errors(name_or_path)`, which turns that into a
`ModelFileError` (an `OSError`, as transformers' own missing-file errors) naming the broken file, its size and what
to do.

Example:
    >>> import os, tempfile
    >>> from transformers import AutoModelForImageClassification
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> folder = tempfile.mkdtemp(); tiny_vit().save_pretrained(folder)
    >>> with open(os.path.join(folder, "model.safetensors"), "r+b") as f:
    ...     _ = f.truncate(100)  # an interrupted copy
    >>> try:
    ...     with explained_load_errors(folder):
    ...         AutoModelForImageClassification.from_pretrained(folder)
    ... except ModelFileError as err:
    ...     print(str(err).startswith(f"cannot read {folder}/model.safetensors (100 bytes)"))
    True
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..errors import ModelFileError


@contextmanager
def explained_load_errors(name_or_path: str):
    """Re-raise a `SafetensorError` from loading `name_or_path` (a local folder or a Hub id in the local cache) as a
    `ModelFileError` that names the unreadable file and the fix."""
    try:
        yield
    except SafetensorError as err:
        local = os.path.isdir(name_or_path)
        broken = _unreadable_file(Path(name_or_path) if local else _cached_snapshot(name_or_path))
        what = (f"cannot read {broken} ({broken.stat().st_size:,} bytes)" if broken
                else f"cannot read a weights file of {name_or_path}")
        fix = (f"save or copy the model again (`save_pretrained`), and check that {name_or_path} is the folder you "
               "mean" if local else f"download it again (`hf download {name_or_path} --force-download`), or delete "
               "that file from the Hugging Face cache so that from_pretrained fetches it anew")
        raise ModelFileError(f"{what}: {err}. The file is truncated or corrupted, e.g. by an interrupted download or "
                             f"copy. Fix: {fix}.") from err


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, or not a repository id: the message stays general
        return None


def _unreadable_file(folder: Path | None) -> Path | None:
    """The first `*.safetensors` file in `folder` that safetensors cannot open."""
    for path in sorted(folder.glob("*.safetensors")) if folder is not None else []:
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError:
            return path
    return None
