"""Model and dataset names that reach for the Hub, checked before any work: a name that is a path but no folder, or a
Hub name that is not in the local cache while offline (`HF_HUB_OFFLINE`) or while the Hub cannot be reached (one
connection attempt, `HUB_PROBE_TIMEOUT` seconds at most), fails at once with a typed error naming what was looked for
and where, instead of a `ConnectionError` / `OSError` after a minute of retries and doubled warnings.

Example:
    >>> try:
    ...     check_dataset_name("./no/such/folder", shipped=("digits",))
    ... except DataError as err:
    ...     print(str(err).split(":")[0])
    --dataset_name './no/such/folder'
"""

from __future__ import annotations

import os

from ..errors import DataError, ModelFileError

TRUE = {"1", "ON", "YES", "TRUE"}
HUB_PROBE_TIMEOUT = 5.0  # seconds: one attempt to reach the Hub's endpoint, instead of the libraries' retries


def hub_offline() -> bool:
    """Whether the Hugging Face libraries are told to stay offline (`HF_HUB_OFFLINE`, as they read it)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE or bool(constants.HF_HUB_OFFLINE)


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the Hub's endpoint (`HF_ENDPOINT`) cannot be reached (one request, through the session and proxies the
    Hugging Face libraries use), or None when it answers. Remembered for the process: one probe per run."""
    if _PROBED:
        return _PROBED[0]
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
        why = None
    except Exception as err:  # noqa: BLE001 - any transport error (DNS, refused, timeout, proxy) means unreachable
        why = f"{constants.ENDPOINT} cannot be reached ({type(err).__name__}: {' '.join(str(err).split())})"
    _PROBED.append(why)
    return why


_PROBED: list = []


def looks_like_path(name: str) -> bool:
    """A local path rather than a Hub id (`name` or `owner/name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def in_local_cache(name: str, repo_type: str) -> str | None:
    """Where the local cache holds `name` (a Hub snapshot, or for a dataset the datasets cache), else None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type=repo_type, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a valid repository id
        pass
    if repo_type == "dataset":
        import datasets

        folder = os.path.join(datasets.config.HF_DATASETS_CACHE, name.replace("/", "___"))
        return folder if os.path.isdir(folder) else None
    return None


def _problem(name: str, flag: str, repo_type: str) -> str | None:
    """Why `name` cannot be loaded, or None when it may be (a folder, a cached name, or the Hub is allowed)."""
    if os.path.exists(os.path.expanduser(name)):
        return None
    folder = os.path.abspath(os.path.expanduser(name))
    if looks_like_path(name):
        return f"{flag} {name!r}: no such folder ({folder})"
    if in_local_cache(name, repo_type):
        return None
    why = "HF_HUB_OFFLINE is set" if hub_offline() else hub_unreachable()
    if why is None:
        return None
    from huggingface_hub import constants

    return (f"{flag} {name!r}: not found. Looked for a local folder {folder} (none), the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (not there), and not on the Hub: {why}")


def check_model_name(name: str, flag: str = "--model_name_or_path", shipped=()) -> None:
    """Raise `ModelFileError` at once when `name` is a missing folder, or a Hub model that cannot be reached."""
    if problem := _problem(name, flag, "model"):
        known = f"; the built-in ones: {', '.join(shipped)}" if shipped else ""
        raise ModelFileError(f"{problem}. Fix: a local path (a folder written by save_pretrained{known}), a model "
                             "in the cache with HF_HUB_OFFLINE=1, or a Hub name with the Hub reachable.")


def check_dataset_name(name: str, flag: str = "--dataset_name", shipped=()) -> None:
    """Raise `DataError` at once when `name` is a missing folder, or a Hub dataset that cannot be reached."""
    if problem := _problem(name, flag, "dataset"):
        known = f"; the shipped datasets (offline): {', '.join(shipped)}" if shipped else ""
        raise DataError(f"{problem}. Fix: a local path (a data folder or file, or a save_to_disk folder{known}), a "
                        "dataset in the cache with HF_HUB_OFFLINE=1, or a Hub name with the Hub reachable.")
