"""Push a DP run to the Hugging Face Hub: weights, metrics, representation laws, the privacy ledger and the DP card.

`push_dp_model(trainer)` uploads an allow-list of files from `trainer.args.output_dir`, so nothing else that a run
leaves there (checkpoints, `training_args.bin`, cached features, public pre-training) is sent:

- the model: `config.json`, `*.safetensors` (or `pytorch_model*.bin`), `generation_config.json`, LoRA adapters,
  tokenizer / image-processor files;
- `all_results.json` (and `train_results.json` / `eval_results.json`);
- `representation_law.json` and the `*.png` plots;
- `privacy_ledger.json`;
- `README.md`: the DP model card (`hf_dp_repr.model_card`), rendered again just before the upload.

The token is the one `huggingface_hub` finds itself (`hf auth login` or `HF_TOKEN`), or the `token` argument; it
is passed to the client and never printed or written. `DPTrainer.push_to_hub()` saves and then calls this.

Example (no network: what would be uploaded):
    >>> from hf_dp_repr.hub import files_to_push
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for name in ("model.safetensors", "config.json", "privacy_ledger.json", "training_args.bin", "README.md"):
    ...     _ = (d / name).write_text("{}")
    >>> files_to_push(d)
    ['README.md', 'config.json', 'model.safetensors', 'privacy_ledger.json']
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from .model_card import write_model_card

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
    "adapter_config.json", "adapter_model.*",
    "tokenizer*.json", "tokenizer.model", "vocab.*", "merges.txt", "special_tokens_map.json",
    "preprocessor_config.json", "processor_config.json", "chat_template.*",
    "all_results.json", "train_results.json", "eval_results.json",
    "representation_law.json", "*.png",
    "privacy_ledger.json", "README.md",
]  # fmt: skip
IGNORE_PATTERNS = ["training_args.bin", "checkpoint-*", "_*"]


def files_to_push(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` (top level only) that `push_dp_model` uploads, sorted."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
    return [n for n in names if any(fnmatch.fnmatch(n, a) for a in ALLOW_PATTERNS)
            and not any(fnmatch.fnmatch(n, i) for i in IGNORE_PATTERNS)]


def push_dp_model(trainer, repo_id: str | None = None, *, commit_message: str = "DP-SGD run (hf-dp-repr)",
                  private: bool | None = None, revision: str | None = None, token: str | None = None):
    """Upload the run in `trainer.args.output_dir` to `repo_id` (default: `args.hub_model_id`, else the output
    folder's name); returns huggingface_hub's `CommitInfo`. Call after `trainer.save_model()`.

    Only the main process uploads; the others return None.
    """
    from huggingface_hub import HfApi

    args = trainer.args
    if not args.should_save:
        return None
    folder = Path(args.output_dir)
    if trainer.ledger is None and not (folder / "privacy_ledger.json").exists():
        raise ValueError("push_dp_model: no privacy ledger (train with DPTrainer and save_model() first); a DP "
                         "model is never pushed without the record of its guarantee.")
    write_model_card(trainer, folder)  # fresh: it now sees all_results.json and the law files
    repo_id = repo_id or args.hub_model_id or folder.resolve().name
    api = HfApi(token=token)
    private = args.hub_private_repo if private is None else private
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                             allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, revision=revision)
