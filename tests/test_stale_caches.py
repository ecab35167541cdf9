"""On-disk feature caches (features of private data) left by a killed process are deleted when the next process
starts, which says what it removed; a running process's cache is left alone; where a cache lives is logged."""

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hf_dp_repr.scope import feature_store
from hf_dp_repr.scope.feature_store import CACHE_PREFIX, CacheEntry, remove_stale_caches

ROOT = Path(__file__).resolve().parents[1]
KILLED = """
import os, signal
import torch
from hf_dp_repr.scope.feature_store import CacheEntry
entry = CacheEntry.allocate(64, (16,), torch.float32, max_memory_gb=0, max_disk_gb=1)  # over the memory bound: disk
entry.states[:] = 1.0
entry.states.flush()
print(entry.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
"""


def test_a_killed_process_leaves_features_that_the_next_process_removes(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED], env=env, cwd=ROOT, capture_output=True, text=True)
    assert killed.returncode == -9
    folder = Path(killed.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith(CACHE_PREFIX)
    assert (folder / "states.npy").stat().st_size == 64 * 16 * 4  # the features are still on disk
    nxt = subprocess.run([sys.executable, "-c", "import hf_dp_repr.scope.feature_store"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert not folder.exists()
    assert "left by killed processes" in nxt.stderr and str(folder) in nxt.stderr


def test_a_running_process_cache_stays_and_its_location_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        entry = CacheEntry.allocate(8, (4,), torch.float32, max_memory_gb=0, max_disk_gb=1)
    try:
        assert Path(entry.folder).parent == tmp_path and f"-{os.getpid()}-" in entry.folder
        assert f"cached on disk in {entry.folder}" in caplog.text
        other_user_or_host = tmp_path / f"{CACHE_PREFIX}otherhost-1-abc"
        other_user_or_host.mkdir()
        assert remove_stale_caches() == [] and Path(entry.folder).exists() and other_user_or_host.exists()
    finally:
        entry.delete()
    assert entry.folder not in feature_store._FOLDERS
