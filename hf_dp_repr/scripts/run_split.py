"""What defines a recipe run's private split, recorded in its `run_info.json`, and the members and non-members
rebuilt from it for `hf-dp-repr audit --run OUTPUT_DIR`.

The record names the recipe, the public fraction it resolved (`--public_fraction` unset means a default), the seed
of the split (the Trainer's `seed`: the public/private split, the per-class selection and `--validation_fraction`
draw with it), the dataset and its `datasets` fingerprint (of the training split as selected, before the split),
and the counts. The audit reloads the dataset by name, refuses it if its fingerprint differs (another revision, other
files), and redoes the recipe's own split. `run_info.json` stays local: `hf-dp-repr push` never uploads it (a
fingerprint of the private data would tell it from its neighbours).

The record is written by `utils.split_record` through `utils.finish_run`; a recipe that records one provides
`audit_sets(run_dir, record, model_args)`.

Example:
    >>> rebuild_members("/nonexistent-run")
    Traceback (most recent call last):
    hf_dp_repr.errors.AuditDataError: /nonexistent-run has no run_info.json: ...
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import AuditDataError
from .utils import RUN_INFO_FILE


def rebuild_members(run_dir: str):
    """(members, non-members) of the recipe run saved in `run_dir`: its private training set (exactly the rows it
    trained on under DP) and its evaluation set (not trained on), rebuilt from `run_info.json`."""
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.is_file():
        raise AuditDataError(f"{run_dir} has no {RUN_INFO_FILE}: --run needs the output_dir of a finished recipe "
                             "run (hf-dp-repr train ...). Pass --model, --members and --non-members instead.")
    info = json.loads(path.read_text())
    record = info.get("split")
    if record is None:
        raise AuditDataError(f"{path} records no split (a run of a recipe without one, or of an older version): "
                             "pass --model, --members and --non-members instead.")
    if record["recipe"] == "image":
        from .image_classification import audit_sets
    elif record["recipe"] == "text":
        from .text_classification import audit_sets
    else:
        raise AuditDataError(f"{path}: recipe {record['recipe']!r} has no membership audit (classification recipes "
                             "only). Pass --members and --non-members instead.")
    members, non_members = audit_sets(run_dir, record, info["model_args"])
    if len(members) != record["members"]:
        raise AuditDataError(f"rebuilt {len(members)} members but the run trained on {record['members']} "
                             f"({RUN_INFO_FILE}): the split cannot be reproduced here.")
    return members, non_members
