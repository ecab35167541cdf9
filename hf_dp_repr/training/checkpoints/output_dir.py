"""The output folder of a DP run: checked writable before any work, and its checkpoints told complete or not.

A checkpoint `checkpoint-N` is complete when it holds the Trainer's state and a readable privacy ledger (DPTrainer
writes the ledger last and renames the folder into place only then; a folder written otherwise, by a kill during an
older version's save or by hand, may lack them). Resuming with `resume_from_checkpoint=True` takes the newest
complete one and says which it skipped.

    >>> import tempfile
    >>> from hf_dp_repr.training.checkpoints.output_dir import check_writable, last_complete_checkpoint
    >>> folder = tempfile.mkdtemp()
    >>> check_writable(folder)  # raises OutputDirError if a file cannot be written there
    >>> last_complete_checkpoint(folder)
    (None, [])
"""

from __future__ import annotations

import os
import re
import tempfile

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ...errors import OutputDirError

STAGING_DIR = ".checkpoint-staging"  # where a checkpoint is written before it is renamed into place
ARGS_FILE = "training_args.json"  # the run's arguments beside its ledger (training_args.bin is a pickle)
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def check_writable(output_dir: str) -> None:
    """Write, flush and remove a probe file in `output_dir` (or, if it does not exist yet, in the nearest folder
    above it, where it would be made); `OutputDirError` naming output_dir if that fails (read-only, full, a file
    in the way). Leaves nothing behind."""
    folder = os.path.abspath(output_dir)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        if not os.path.isdir(folder):
            raise NotADirectoryError(f"{folder} is a file")
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".hf-dp-repr-probe-")
        try:
            os.write(fd, b"\0" * 4096)  # a block: a full disk refuses it
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise OutputDirError(
            f"DPTrainer: output_dir {output_dir!r} cannot be written ({type(e).__name__}: {e}); the first checkpoint "
            "or the final model would fail after training. Fix: pass an output_dir on a writable disk with room for "
            "the model."
        ) from None


def checkpoints(folder: str) -> list[str]:
    """The `checkpoint-N` folders of `folder`, newest (largest N) first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(folder, name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def incomplete_reason(checkpoint: str) -> str | None:
    """Why the checkpoint folder cannot be resumed from (no trainer state, no or an unreadable ledger), or None."""
    from ...privacy.ledger import LEDGER_FILE, PrivacyLedger

    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        return f"no {TRAINER_STATE}"
    try:
        PrivacyLedger.load(checkpoint)
    except FileNotFoundError:
        return f"no {LEDGER_FILE}"
    except ValueError:
        return f"{LEDGER_FILE} unreadable (an interrupted save?)"
    return None


def last_complete_checkpoint(folder: str) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint of `folder` or None, the newer incomplete ones as "name (why)")."""
    skipped = []
    for path in checkpoints(folder):
        reason = incomplete_reason(path)
        if reason is None:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({reason})")
    return None, skipped


def fsync_folder(folder: str, files: bool = False) -> None:
    """Flush `folder`'s entries (and, with `files`, every file below it) to disk, where the OS allows it."""
    if files:
        for root, _, names in os.walk(folder):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a folder cannot be opened for fsync on some systems (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
