"""The process-wide store of features computed once from frozen weights: the hidden states entering the first
trained block (`prefix_cache`) and the linear probe's head inputs (`cached_head`).

An entry is keyed by what determines it: the model class, where the features are taken, a hash of every frozen
weight and buffer they depend on, the dataset's fingerprint and length, and the collator. So evaluation, later
`train()` calls and a sweep's trials (a fresh `model_init` model with the same frozen weights) reuse it, and a
changed weight or dataset never does. Entries hold features of private data: they live in this process only (or,
past the memory bound and only if allowed, in a fresh temporary folder deleted at exit), are no module buffer, so in
no state_dict, checkpoint or push; `clear_feature_cache()` frees them all.

On disk they live in the system temporary folder (`tempfile.gettempdir()`: $TMPDIR, else /tmp), in folders named
`hf-dp-repr-features-<host>-<pid>-*` (the location is logged when one is made). A process killed before its exit
handlers ran (kill -9, out of memory) leaves its folder behind: the next process that imports this module deletes
the folders of this user whose process, on this host, is no longer running (`remove_stale_caches`), with a warning.

    >>> import tempfile
    >>> remove_stale_caches(tempfile.mkdtemp())  # a folder without caches: nothing to remove
    []
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import socket
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

logger = logging.getLogger(__name__)
CACHE_PREFIX = "hf-dp-repr-features-"  # + <host>-<pid>-<random>: see the module's docstring


class NotCacheable(RuntimeError):
    """The features cannot be cached without changing the updates (or do not fit the bounds)."""


def data_reason_not_to_cache(dataset) -> str | None:
    """Why the dataset's examples may differ between epochs (None if they cannot)."""
    if not isinstance(dataset, datasets.Dataset):
        return f"the dataset is a {type(dataset).__name__}, whose items may be random (augmentation)"
    if dataset.format.get("type") == "custom":
        return "the dataset has a transform (set_transform / with_transform), which may be random augmentation"
    return None


def weights_digest(named_tensors) -> str:
    """A hash of (name, bytes) of every tensor the features depend on."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in named_tensors:
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def dataset_key(dataset, collator) -> tuple:
    """The part of a key that names the data: fingerprint (or object id), length, collator."""
    return getattr(dataset, "_fingerprint", None) or f"id{id(dataset)}", len(dataset), repr(collator)


@dataclass
class CacheEntry:
    """One dataset's prefix states: a tensor in memory, or a memmap in `folder` (a fresh temporary folder)."""

    states: torch.Tensor | np.memmap
    folder: str | None = None

    @property
    def nbytes(self) -> int:
        return self.states.nbytes if self.folder else self.states.numel() * self.states.element_size()

    @classmethod
    def allocate(cls, n: int, shape, dtype, max_memory_gb: float, max_disk_gb: float) -> "CacheEntry":
        size = n * int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if size <= max_memory_gb * 2**30:
            evict_until(max_memory_gb * 2**30 - size)
            return cls(torch.empty((n, *shape), dtype=dtype))
        if size <= max_disk_gb * 2**30:
            folder = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{_host()}-{os.getpid()}-")
            _FOLDERS.add(folder)
            logger.info(f"features of private data cached on disk in {folder} (deleted at exit; if this process is "
                        "killed, by the next one that starts)")
            np_dtype = torch.empty((), dtype=dtype).numpy().dtype
            return cls(np.memmap(f"{folder}/states.npy", dtype=np_dtype, mode="w+", shape=(n, *shape)), folder)
        raise NotCacheable(f"the states need {size / 2**30:.2f} GiB, over cache_features_max_memory_gb="
                           f"{max_memory_gb} and cache_features_max_disk_gb={max_disk_gb}")

    def delete(self) -> None:
        if self.folder:
            del self.states
            shutil.rmtree(self.folder, ignore_errors=True)
            _FOLDERS.discard(self.folder)


# Entries: CacheEntry (prefix states) or cached_head.CachedHeadInputs; each has `nbytes`, `folder`, `delete()`.
_STORE: OrderedDict[tuple, object] = OrderedDict()
_FOLDERS: set[str] = set()


def clear_feature_cache() -> None:
    """Free every cached feature of this process (memory and temporary files)."""
    while _STORE:
        _STORE.popitem(last=False)[1].delete()


def evict_until(free_bytes: float) -> None:
    """Drop the oldest in-memory entries until the rest take at most `free_bytes`."""
    while _STORE and sum(e.nbytes for e in _STORE.values() if not e.folder) > max(free_bytes, 0):
        oldest = next((k for k, e in _STORE.items() if not e.folder), None)
        if oldest is None:
            return
        _STORE.pop(oldest).delete()


def lookup(key: tuple):
    """The entry for `key` (marked most recently used), or None."""
    if key in _STORE:
        _STORE.move_to_end(key)
        return _STORE[key]
    return None


def store(key: tuple, entry) -> None:
    _STORE[key] = entry


@atexit.register
def _delete_folders() -> None:
    for folder in list(_FOLDERS):
        shutil.rmtree(folder, ignore_errors=True)


# ---- folders left by killed processes ------------------------------------------------------------------------------
def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks that the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_caches(folder: str | None = None) -> list[str]:
    """Delete the on-disk feature caches in `folder` (default: the system temporary folder) that processes of this
    user on this host left behind when they were killed; returns their paths. Another host's (a shared temporary
    folder) and another user's are left alone, and so is everything on systems without POSIX process checks."""
    if os.name != "posix":
        return []
    prefix = f"{CACHE_PREFIX}{_host()}-"
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if not (pid.isdigit() and path.is_dir() and path.stat().st_uid == os.getuid()) or _running(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    if removed:
        logger.warning(f"removed {len(removed)} feature cache folder(s) of private data left by killed processes: "
                       f"{', '.join(removed)}")
    return removed


remove_stale_caches()  # at the start of every process that may cache features
