"""Push a DP run to the Hugging Face Hub: weights, metrics, representation laws, the privacy ledger and the DP card.

Every push goes through `upload_run`, which uploads an allow-list of the top-level files of a run folder, so
nothing else that a run leaves there (checkpoints, `training_args.bin`, `trainer_state.json`, optimizer / RNG
state, cached features, public pre-training, logs) is ever sent:

- the model: `config.json`, `*.safetensors` (or `pytorch_model*.bin`), `generation_config.json`, LoRA adapters,
  tokenizer / image-processor files;
- `all_results.json` and `eval_results.json`, refused if they hold a `train_*` metric (computed on private data
  outside DP-SGD) or a counter of the training batches' rows or tokens (`total_flos`, `num_input_tokens_seen`,
  TRL's `eval_num_tokens`, ...: the sizes of the secret Poisson batches; `public_names.is_private_metric`);
  `DPTrainer.save_metrics` never writes them;
- `representation_law.json` and the `*.png` plots;
- `privacy_ledger.json` (required: a DP model is never pushed without the record of its guarantee), and
  `hp_search.json` beside a model selected by a private hyperparameter search (the search's ε, stated by the card);
- `README.md`: the DP model card (`hf_dp_repr.hub.card`).

The pushes: `push_dp_model(trainer)` (after training; `DPTrainer.push_to_hub()` saves and calls it),
`DPTrainer`'s pushes during training (`hub_strategy="every_save"`, from each checkpoint) and
`hf-dp-repr push OUTPUT_DIR --hub_model_id me/name` (a finished run, later). `check_hub_access` checks login
and write access before any work (the recipes and `DPTrainer(push_to_hub=True)` call it first).

The token is the one `huggingface_hub` finds itself (`hf auth login` or `HF_TOKEN`), or the `token` argument; it
is passed to the client and never printed or written.

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

import contextlib
import fnmatch
import json
import math
import os
from pathlib import Path

from ..errors import ArgumentError, DataError, HubAccessError, LedgerError
from ..privacy.ledger import LEDGER_FILE
from .card import CARD_FILE, SEARCH_FILE, write_model_card
from .public_names import is_private_metric

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
    "adapter_config.json", "adapter_model.*",
    "tokenizer*.json", "tokenizer.model", "vocab.*", "merges.txt", "special_tokens_map.json",
    "preprocessor_config.json", "processor_config.json", "chat_template.*",
    "all_results.json", "eval_results.json",
    "representation_law.json", "*.png", "canary_audit.json", "canary_exposure.json",
    LEDGER_FILE, CARD_FILE, SEARCH_FILE,
]  # fmt: skip
# Never sent, whatever the allow-list says: anything in a subfolder (checkpoints, public pre-training, logs), and
# the Trainer's files that hold private statistics or the seed.
IGNORE_PATTERNS = ["*/*", ".*", "_*", "checkpoint-*", "training_args.bin", "trainer_state.json", "rng_state*",
                   "optimizer.*", "scheduler.*", "scaler.*", "train_results.json",
                   "privacy_audit*"]  # hf-dp-repr audit: computed on the private members outside DP-SGD
METRICS_FILES = ("all_results.json", "eval_results.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "adapter_model.*")
PUSH_LATER = "a finished run can be pushed later with `hf-dp-repr push OUTPUT_DIR --hub_model_id me/name`"
LOGIN_HINT = ("log in with `hf auth login` or set HF_TOKEN to a token with write access "
              "(https://huggingface.co/settings/tokens)")


def files_to_push(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` (top level only) that every push uploads, sorted."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
    return [n for n in names if any(fnmatch.fnmatchcase(n, a) for a in ALLOW_PATTERNS)
            and not any(fnmatch.fnmatchcase(n, i) for i in IGNORE_PATTERNS)]


# ---- metrics: nothing computed on the private data ------------------------------------------------------------
def public_metrics(metrics: dict) -> dict:
    """`metrics` without its private keys (`train_*`, counters of the batches), with ε = ∞ (and any non-finite
    number) as null so the JSON is valid."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items() if not is_private_metric(k)}


def save_public_metrics(output_dir: str | os.PathLike, split: str, metrics: dict, combined: bool = True) -> None:
    """`Trainer.save_metrics` for a DP run: `{split}_results.json` (and, if `combined`, `all_results.json`, merged
    with what is there) without private keys (`train_*`, counters of the batches) and as valid JSON."""
    path = Path(output_dir) / f"{split}_results.json"
    path.write_text(json.dumps(public_metrics(metrics), indent=4, sort_keys=True, allow_nan=False))
    if combined:
        path = Path(output_dir) / "all_results.json"
        merged = {**(json.loads(path.read_text()) if path.is_file() else {}), **metrics}
        path.write_text(json.dumps(public_metrics(merged), indent=4, sort_keys=True, allow_nan=False))


def check_pushable(folder: str | os.PathLike) -> None:
    """Refuse a folder without a readable privacy ledger, or whose metrics files hold private keys (`train_*`,
    counters of the training batches' rows or tokens: `public_names.is_private_metric`)."""
    folder = Path(folder)
    ledger = folder / LEDGER_FILE
    if not ledger.is_file():
        raise LedgerError(f"push: {folder} has no {LEDGER_FILE}; a DP model is never pushed without the record of its "
                          "guarantee. Push a folder written by DPTrainer.save_model().")
    try:
        json.loads(ledger.read_text())
    except ValueError as err:
        raise LedgerError(f"push: {ledger} is not valid JSON ({err}); re-save the run with DPTrainer.") from None
    for name in METRICS_FILES:
        path = folder / name
        if path.is_file():
            private = sorted(k for k in json.loads(path.read_text()) if is_private_metric(k))
            if private:
                raise DataError(f"push: {path} holds {', '.join(private)}, computed on the private data outside "
                                "DP-SGD (or, for a count of rows, tokens or flos, on the secret batch sizes). Remove "
                                "those keys (DPTrainer.save_metrics never writes them) and push again.")


# ---- access --------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def explained_hub_errors(action: str):
    """Turn huggingface_hub's login / offline / network errors into a `HubAccessError` that says what to do."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    try:
        yield
    except LocalTokenNotFoundError:
        raise HubAccessError(f"{action}: not logged in to the Hugging Face Hub; {LOGIN_HINT}.") from None
    except OfflineModeIsEnabled:
        raise HubAccessError(_offline_message(action)) from None
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        hint = LOGIN_HINT if status in (401, 403) else "check the repository name and your access to it"
        raise HubAccessError(f"{action}: the Hub refused ({status}: {err}); {hint}.") from err
    except HubAccessError:
        raise
    except Exception as err:
        if not _is_network_error(err):
            raise
        raise HubAccessError(f"{action}: cannot reach the Hugging Face Hub ({type(err).__name__}: {err}). Check the "
                             f"network; {PUSH_LATER}.") from err


def _offline_message(action: str) -> str:
    return f"{action}: offline mode is on (HF_HUB_OFFLINE=1). Unset HF_HUB_OFFLINE; {PUSH_LATER}."


def _is_network_error(err: Exception) -> bool:
    """DNS, proxy, TLS, timeouts: OSError or the HTTP client's own exception types."""
    return isinstance(err, OSError) or type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")


def check_hub_access(repo_id: str, token: str | None = None) -> str:
    """Check, before any work, that we are logged in and may write to `repo_id`; returns the full `owner/name`.

    Raises `HubAccessError` naming the fix (`hf auth login` / HF_TOKEN, HF_HUB_OFFLINE, --hub_model_id)."""
    from huggingface_hub import HfApi, constants

    action = f"push to {repo_id}"
    if constants.HF_HUB_OFFLINE:
        raise HubAccessError(_offline_message(action))
    with explained_hub_errors(action):
        me = HfApi(token=token).whoami()
    user = me.get("name", "?")
    access = (me.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise HubAccessError(f"{action}: the token of {user} is read-only; {LOGIN_HINT}.")
    namespace, _, name = repo_id.rpartition("/")
    namespace = namespace or user
    writable = [user] + [o["name"] for o in me.get("orgs") or [] if o.get("roleInOrg") != "read"]
    if namespace not in writable:
        raise HubAccessError(f"{action}: logged in as {user}, who can create repositories in {writable}, not in "
                             f"{namespace!r}. Set --hub_model_id {user}/{name}, or log in as a member of {namespace}.")
    scoped = (access.get("fineGrained") or {}).get("scoped")
    if access.get("role") == "fineGrained" and scoped is not None and not any(
            "repo.write" in s.get("permissions", []) and (s.get("entity") or {}).get("name") in (namespace, repo_id)
            for s in scoped):
        raise HubAccessError(f"{action}: the fine-grained token of {user} has no 'repo.write' permission on "
                             f"{namespace}; {LOGIN_HINT}.")
    return f"{namespace}/{name}"


# ---- the pushes ------------------------------------------------------------------------------------------------------
def upload_run(folder: str | os.PathLike, repo_id: str, *, commit_message: str, revision: str | None = None,
               token: str | None = None, run_as_future: bool = False):
    """Upload the allow-listed top-level files of `folder` to the existing repository `repo_id` (every push ends
    here), on branch `revision` (created from main if missing). Refuses (nothing sent) a folder that
    `check_pushable` refuses."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    check_pushable(folder)
    api = HfApi(token=token)
    with explained_hub_errors(f"push to {repo_id}"):
        if revision is not None:  # the Hub refuses a commit to a missing branch; `hf upload --revision` creates it too
            try:
                api.repo_info(repo_id, revision=revision)
            except RevisionNotFoundError:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, revision=revision,
            allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, run_as_future=run_as_future)


def create_repo(repo_id: str, *, private: bool | None = None, token: str | None = None,
                repo_type: str | None = None) -> str:
    """Create `repo_id` (a model repository, or `repo_type="dataset"`) if it does not exist; returns its full
    `owner/name`."""
    from huggingface_hub import HfApi

    with explained_hub_errors(f"create the repository {repo_id}"):
        return HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True, repo_type=repo_type).repo_id


def push_dp_model(trainer, repo_id: str | None = None, *, commit_message: str = "DP-SGD run (hf-dp-repr)",
                  private: bool | None = None, revision: str | None = None, token: str | None = None,
                  run_as_future: bool = False):
    """Upload the run in `trainer.args.output_dir` to `repo_id` (default: `args.hub_model_id`, else the output
    folder's name); returns huggingface_hub's `CommitInfo`. Call after `trainer.save_model()`.

    Only the main process uploads; the others return None.
    """
    args = trainer.args
    if not args.should_save:
        return None
    folder = Path(args.output_dir)
    if trainer.ledger is None and not (folder / LEDGER_FILE).exists():
        raise LedgerError("push_dp_model: no privacy ledger (train with DPTrainer and save_model() first); a DP "
                          "model is never pushed without the record of its guarantee.")
    check_pushable(folder)  # before the card is written: nothing written on error
    repo_id = repo_id or args.hub_model_id or folder.resolve().name
    repo_id = create_repo(repo_id, private=args.hub_private_repo if private is None else private, token=token)
    write_model_card(trainer, folder)  # fresh: it now sees all_results.json and the law files
    return upload_run(folder, repo_id, commit_message=commit_message, revision=revision, token=token,
                      run_as_future=run_as_future)


def push_run_folder(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                    revision: str | None = None, commit_message: str = "DP-SGD run (hf-dp-repr)",
                    token: str | None = None, dry_run: bool = False):
    """`hf-dp-repr push`: push a finished run's folder through the allow-list, its card refreshed from the ledger.

    Every check (folder, ledger, weights, metrics, login and write access) comes before anything is written.
    `dry_run`: run the local checks and return the card that would be pushed; nothing is written or sent."""
    from .card import refresh_model_card
    from .public_names import public_adapter_config

    folder = Path(folder)
    if not folder.is_dir():
        raise ArgumentError(f"hf-dp-repr push: {folder} is not a folder; give the output_dir of a DPTrainer run.")
    check_pushable(folder)
    if not any(fnmatch.fnmatchcase(n, w) for n in files_to_push(folder) for w in WEIGHT_PATTERNS):
        raise ArgumentError(f"hf-dp-repr push: {folder} holds no model weights (*.safetensors, pytorch_model*.bin, "
                            "adapter_model.*); save the model with DPTrainer.save_model() first.")
    card = refresh_model_card(folder, write=False)  # rendered (and checked) before anything is written
    if dry_run:
        return card
    repo_id = create_repo(check_hub_access(repo_id, token), private=private, token=token)
    card.save(folder / CARD_FILE)
    public_adapter_config(folder)  # a run saved before adapters' local base paths were removed
    return upload_run(folder, repo_id, commit_message=commit_message, revision=revision, token=token)
