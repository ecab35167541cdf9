"""Every push, during and after training and from the CLI, sends exactly the allow-listed files: never the Trainer's
state, optimizer / RNG state, training_args.bin or a metric computed on the private data. Login and write access are
checked before any work. The pushes go through the real huggingface_hub client to a local Hub-compatible server
(the `hub` fixture, hf_dp_repr/hub/local_server.py), and what arrives is read back with the client (`hf_hub_download`,
`ModelCard.load`, `from_pretrained`)."""

import json
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, constants, hf_hub_download, metadata_load
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main as cli_main
from hf_dp_repr.errors import HubAccessError
from hf_dp_repr.hub import check_hub_access, create_repo, upload_run
from hf_dp_repr.hub.card import format_epsilon
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import free_port, make_token_dataset

WEIGHTS_LEDGER_CARD = ["README.md", "config.json", "model.safetensors", "privacy_ledger.json"]
AFTER_TRAINING = ["README.md", "all_results.json", "config.json", "model.safetensors", "privacy_ledger.json"]
# What a run leaves at the top of output_dir, or a user puts there, that must never be pushed.
DECOYS = ["training_args.bin", "trainer_state.json", "rng_state.pth", "rng_state_0.pth", "optimizer.pt",
          "scheduler.pt", "scaler.pt", "train_results.json", "run_info.json", "public_pretrained/model.safetensors",
          "public_pretrained/config.json", "runs/events.out.tfevents.1", "plots/private_train.png"]
REPO = "someone/dp-digits"


def _no_nan(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not valid JSON: {c}"))


def _plant_decoys(folder: Path):
    for name in DECOYS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")


def _download(repo_id: str, name: str, revision: str | None = None) -> bytes:
    return Path(hf_hub_download(repo_id, name, revision=revision)).read_bytes()


def _finish_pushes(trainer):
    """Pushes during training run in the background: wait for those still running and raise their errors."""
    for job in trainer.push_in_progress.jobs if trainer.push_in_progress else []:
        job.result()


def _train(out: Path, digits, **hub_args):
    _plant_decoys(out)
    args = DPTrainingArguments(output_dir=str(out), noise_multiplier=0.55, target_delta=1e-4, max_steps=4,
                               per_device_train_batch_size=32, learning_rate=1e-3, report_to="none",
                               save_strategy="steps", save_steps=2, disable_tqdm=True, push_to_hub=True,
                               hub_model_id=REPO, hub_always_push=True, **hub_args)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    trainer.model_card_info = {"private_data": "digits train split"}
    result = trainer.train()
    _finish_pushes(trainer)
    return trainer, result


def _push_after_training(trainer, result, hub):
    out = Path(trainer.args.output_dir)
    metrics = {**result.metrics, "eval_accuracy": 0.5, "epsilon": trainer.epsilon()}
    assert "train_loss" in metrics
    trainer.save_metrics("all", metrics, combined=False)  # as the recipes' finish_run does
    trainer.push_to_hub()
    assert hub.pushes(REPO)[-1] == AFTER_TRAINING
    assert HfApi().list_repo_files(REPO) == [".gitattributes"] + AFTER_TRAINING
    for name in AFTER_TRAINING:  # byte for byte what is in output_dir
        assert _download(REPO, name) == (out / name).read_bytes(), name
    sent = _no_nan(_download(REPO, "all_results.json").decode())
    assert not [k for k in sent if k.startswith("train_")] and {"epsilon", "epoch", "eval_accuracy"} <= set(sent)
    card = ModelCard.load(REPO)  # downloaded from the Hub
    metadata = metadata_load(hf_hub_download(REPO, "README.md"))
    assert "differential-privacy" in metadata["tags"] and metadata == card.data.to_dict()
    assert "digits train split" in card.text
    ledger = json.loads(_download(REPO, "privacy_ledger.json"))
    assert ledger["steps_done"] == 4 and f"**{format_epsilon(ledger['epsilon'])}**" in card.text


def test_every_save_pushes_weights_ledger_and_card_only(tmp_path, digits, hub):
    trainer, result = _train(tmp_path, digits, hub_strategy="every_save")
    assert len(hub.calls("GET", "whoami")) == 1 and not hub.repos[REPO].private  # access checked at DPTrainer(...)
    assert hub.pushes(REPO) == [WEIGHTS_LEDGER_CARD, WEIGHTS_LEDGER_CARD]  # the saves at steps 2 and 4
    at_step_2, at_step_4 = hub.repos[REPO].commits[1:]
    assert at_step_2.title == "Training in progress, step 2"
    assert json.loads(_download(REPO, "privacy_ledger.json", revision=at_step_2.oid))["steps_done"] == 2
    assert json.loads(_download(REPO, "privacy_ledger.json", revision=at_step_4.oid))["steps_done"] == 4
    weights = (tmp_path / "checkpoint-4" / "model.safetensors").read_bytes()
    assert _download(REPO, "model.safetensors", revision=at_step_4.oid) == weights
    _push_after_training(trainer, result, hub)


def test_a_push_during_training_is_not_overwritten_by_the_next_save(tmp_path, digits, hub):
    """hub_always_push: the save at step 2 comes while the Hub is still answering the push of step 1; the files that
    push sends (card, weights, ledger) must all be those of step 1, not a mix with the next save's."""
    hub.hold_uploads = threading.Event()

    class ReleaseAtStep2(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                hub.hold_uploads.set()

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.55, target_delta=1e-4, max_steps=2,
                               per_device_train_batch_size=32, report_to="none", save_strategy="steps", save_steps=1,
                               disable_tqdm=True, push_to_hub=True, hub_model_id=REPO, hub_always_push=True)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"], callbacks=[ReleaseAtStep2()])
    trainer.train()
    _finish_pushes(trainer)
    commits = hub.repos[REPO].commits[1:]
    assert [c.title for c in commits] == ["Training in progress, step 1", "Training in progress, step 2"]
    for step, commit in enumerate(commits, start=1):
        ledger = json.loads(commit.files["privacy_ledger.json"])
        assert ledger["steps_done"] == step
        assert commit.files["model.safetensors"] == (tmp_path / f"checkpoint-{step}/model.safetensors").read_bytes()
        assert f"**{format_epsilon(ledger['epsilon'])}**" in commit.files["README.md"].decode()


def test_hub_strategy_end_pushes_once_after_training(tmp_path, digits, hub):
    trainer, result = _train(tmp_path, digits, hub_strategy="end", hub_private_repo=True)
    assert hub.pushes(REPO) == [] and hub.repos[REPO].private
    _push_after_training(trainer, result, hub)


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_hub_strategies_that_push_resumable_checkpoints_are_refused(strategy, tmp_path, digits, hub):
    with pytest.raises(ValueError, match=f"hub_strategy='{strategy}' pushes resumable checkpoints: "
                                         r"trainer_state.json .*Use hub_strategy='every_save'"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, push_to_hub=True, hub_strategy=strategy)
    DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, hub_strategy=strategy)  # not pushing: fine
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none")
    args.set_push_to_hub("someone/x", strategy=strategy)  # bypasses the arguments' own check
    with pytest.raises(ValueError, match="resumable checkpoints"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    assert hub.repos == {} and not hub.calls("POST", "/commit/")


def test_metrics_files_drop_train_keys_and_are_valid_json(tmp_path, digits):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, report_to="none")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    (tmp_path / "all_results.json").write_text(json.dumps({"train_loss": 0.1, "eval_accuracy": 0.3}))
    trainer.save_metrics("train", {"train_loss": 0.2, "train_runtime": 1.0, "epoch": 3.0, "epsilon": math.inf})
    assert _no_nan((tmp_path / "train_results.json").read_text()) == {"epoch": 3.0, "epsilon": None}
    assert _no_nan((tmp_path / "all_results.json").read_text()) == {"epoch": 3.0, "epsilon": None,
                                                                    "eval_accuracy": 0.3}


# ---- access is checked first -----------------------------------------------------------------------------------
LOGIN = r"log in with `hf auth login` or set HF_TOKEN to a token with write access"
OFFLINE = r"push to someone/x: offline mode is on \(HF_HUB_OFFLINE=1\)\. Unset HF_HUB_OFFLINE; .*`hf-dp-repr push OUT"


@pytest.mark.parametrize("case, repo_id, message", [
    ("no_token", "someone/x", r"push to someone/x: not logged in to the Hugging Face Hub; " + LOGIN),
    ("hf_wrong", "someone/x", r"push to someone/x: the Hub refused \(401: Invalid user token\. The token from HF_TOKEN "
                              r"environment variable is invalid\..*\); " + LOGIN),
    ("hf_read_someone", "someone/x", r"push to someone/x: the token of someone is read-only; " + LOGIN),
    ("hf_write_someone", "other/x", r"logged in as someone, who can create repositories in \['someone', 'dp-lab'\], "
                                    r"not in 'other'\. Set --hub_model_id someone/x, or log in as a member of other"),
    ("hf_write_someone", "readers/x", r"logged in as someone, .*not in 'readers'"),  # an org where we only read
    ("hf_scoped_someone", "someone/x", r"the fine-grained token of someone has no 'repo.write' permission on someone"),
    ("offline", "someone/x", OFFLINE),
    ("unreachable", "someone/x", r"push to someone/x: cannot reach the Hugging Face Hub \(ConnectError: .*\)\. "
                                 r"Check the network; a finished run can be pushed later with `hf-dp-repr push"),
])
def test_check_hub_access_names_the_fix(case, repo_id, message, hub, monkeypatch):
    if case == "no_token":
        monkeypatch.delenv("HF_TOKEN")
    elif case == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    elif case == "unreachable":
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    else:
        monkeypatch.setenv("HF_TOKEN", case)
    with pytest.raises(HubAccessError, match=message):
        check_hub_access(repo_id)
    assert hub.repos == {}


def test_check_hub_access_lets_through_our_namespaces(hub, monkeypatch):
    assert check_hub_access("x") == "someone/x" and check_hub_access("someone/x") == "someone/x"
    assert check_hub_access("dp-lab/x") == "dp-lab/x"  # an org where we write
    monkeypatch.setenv("HF_TOKEN", "hf_scoped_someone")
    assert check_hub_access("someone/allowed") == "someone/allowed"  # the repository the token is scoped to


def test_the_local_hub_refuses_what_the_hub_refuses(hub, monkeypatch):
    """The server the push tests run against enforces access itself, as huggingface.co does."""
    api = HfApi()
    api.create_repo("someone/mine", private=True)
    with pytest.raises(HfHubHTTPError, match="rights to create a model under the namespace") as err:
        api.create_repo("other/theirs")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError, match="Invalid user token"):
        HfApi(token="hf_wrong").whoami()
    with pytest.raises(HfHubHTTPError, match="rights to create"):
        HfApi(token="hf_read_someone").create_repo("someone/y")
    for token in (False, "hf_write_other"):  # anonymous, another user: a private repository is not there
        with pytest.raises(RepositoryNotFoundError):
            HfApi(token=token).model_info("someone/mine")
    assert api.model_info("someone/mine").private


def test_recipe_checks_the_hub_before_any_work(tmp_path, hub, monkeypatch):
    from hf_dp_repr.scripts import image_classification as image_recipe

    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubAccessError, match="hf auth login"):
        image_recipe.main(["--output_dir", str(tmp_path / "run"), "--target_epsilon", "1", "--max_steps", "1",
                           "--report_to", "none", "--push_to_hub", "true", "--hub_model_id", "someone/x"])
    assert not (tmp_path / "run").exists()  # no public pre-training, nothing written
    assert hub.requests == []  # no token: not one request


def test_dp_trainer_with_push_to_hub_checks_access_at_construction(tmp_path, digits, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_read_someone")
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none", push_to_hub=True,
                               hub_model_id="someone/x")
    with pytest.raises(HubAccessError, match="read-only"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    assert hub.repos == {}


# ---- hf-dp-repr push OUTPUT_DIR ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("finished")
    args = DPTrainingArguments(output_dir=str(out), noise_multiplier=0.55, target_delta=1e-4, max_steps=2,
                               per_device_train_batch_size=32, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    trainer.model_card_info = {"private_data": "digits train split", "model_name": "tiny_vit fine-tuned on digits"}
    result = trainer.train()
    trainer.save_metrics("all", {**result.metrics, "eval_accuracy": 0.5, "epsilon": trainer.epsilon()},
                         combined=False)
    trainer.save_model()
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    _plant_decoys(dest)
    return dest


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_push_sends_the_allow_list_with_a_card_refreshed_from_the_ledger(finished_run, tmp_path, hub, capsys,
                                                                             monkeypatch):
    folder = _copy(finished_run, tmp_path / "run")
    ledger = json.loads((folder / "privacy_ledger.json").read_text())
    eps = f"**{format_epsilon(ledger['epsilon'])}**"
    stale = (folder / "README.md").read_text()
    assert eps in stale
    (folder / "README.md").write_text(stale.replace(eps, "**999**"))  # refreshed from the ledger below
    (folder / "representation_law.png").write_bytes(b"png")
    assert cli_main(["push", str(folder), "--hub_model_id", "someone/pushed-later", "--private"]) == 0
    sent = ["README.md", "all_results.json", "config.json", "model.safetensors", "privacy_ledger.json",
            "representation_law.png"]
    assert len(hub.calls("GET", "whoami")) == 1 and hub.pushes("someone/pushed-later") == [sent]
    assert hub.repos["someone/pushed-later"].commits[-1].title == "DP-SGD run (hf-dp-repr)"
    for name in sent:
        assert _download("someone/pushed-later", name) == (folder / name).read_bytes(), name
    card = ModelCard.load("someone/pushed-later")
    assert eps in card.text and "**999**" not in card.text and "| eval_accuracy | 0.5 |" in card.text
    assert card.text.lstrip().startswith("# tiny_vit fine-tuned on digits (DP-SGD, ε = ")
    assert "differential-privacy" in card.data.tags and "digits train split" in card.text  # kept from the old card
    assert f"pushed {', '.join(sent)} to {hub.url}/someone/pushed-later/commit/" in capsys.readouterr().out
    # --private: the repository is not there for anyone else
    assert HfApi().model_info("someone/pushed-later").private
    for token in (None, "hf_write_other"):
        monkeypatch.delenv("HF_TOKEN") if token is None else monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("someone/pushed-later", "model.safetensors", cache_dir=tmp_path / f"cache-{token}")


def test_cli_push_to_a_new_branch_creates_it(finished_run, tmp_path, hub):
    """The Hub refuses a commit to a revision that does not exist; `--revision` creates the branch from main, as
    `hf upload --revision` does."""
    folder = _copy(finished_run, tmp_path / "run")
    assert cli_main(["push", str(folder), "--hub_model_id", "someone/branched", "--revision", "eps-3",
                     "--commit_message", "the run on a branch"]) == 0
    refs = {ref.name: ref.target_commit for ref in HfApi().list_repo_refs("someone/branched").branches}
    assert HfApi().list_repo_files("someone/branched") == [".gitattributes"]  # main untouched
    assert HfApi().list_repo_files("someone/branched", revision="eps-3") == [".gitattributes"] + AFTER_TRAINING
    assert hub.repos["someone/branched"].commit(refs["eps-3"]).title == "the run on a branch"
    assert _download("someone/branched", "privacy_ledger.json", revision="eps-3") == \
        (folder / "privacy_ledger.json").read_bytes()


@pytest.mark.parametrize("case, message", [
    ("no_ledger", r"has no privacy_ledger.json; a DP model is never pushed without the record of its guarantee"),
    ("private_metric", r"all_results.json holds train_loss, computed on the private data"),
    ("no_weights", r"holds no model weights"),
    ("not_logged_in", r"not logged in to the Hugging Face Hub; log in with `hf auth login`"),
    ("wrong_token", r"push to someone/x: the Hub refused \(401: Invalid user token.*" + LOGIN),
    ("foreign_namespace", r"logged in as someone, .*not in 'other'\. Set --hub_model_id someone/x"),
])
def test_cli_push_refuses_and_writes_nothing(case, message, finished_run, tmp_path, hub, monkeypatch):
    folder = _copy(finished_run, tmp_path / "run")
    (folder / "README.md").unlink()  # a push that went through would write it
    repo_id = "other/x" if case == "foreign_namespace" else "someone/x"
    if case == "no_ledger":
        (folder / "privacy_ledger.json").unlink()
    elif case == "private_metric":
        (folder / "all_results.json").write_text(json.dumps({"train_loss": 0.3, "eval_accuracy": 0.5}))
    elif case == "no_weights":
        (folder / "model.safetensors").unlink()
    elif case == "not_logged_in":
        monkeypatch.delenv("HF_TOKEN")
    elif case == "wrong_token":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    before = _snapshot(folder)
    with pytest.raises(SystemExit, match=message):
        cli_main(["push", str(folder), "--hub_model_id", repo_id])
    assert _snapshot(folder) == before and hub.repos == {} and not hub.calls("POST", "/commit/")


def test_push_into_a_foreign_repository_is_refused_by_the_hub(finished_run, tmp_path, hub):
    """`trainer.push_to_hub()` (`push_dp_model`) does not ask whoami first: its steps, creating the repository and
    uploading, turn the Hub's own 403 into a HubAccessError."""
    HfApi(token="hf_write_other").create_repo("other/theirs")
    folder = _copy(finished_run, tmp_path / "run")
    refused = r"(?s){}: the Hub refused \(403: .*You don't have .*\); " + LOGIN
    with pytest.raises(HubAccessError, match=refused.format("create the repository other/new")):
        create_repo("other/new")
    assert create_repo("other/theirs") == "other/theirs"  # exists and is public: create_repo(exist_ok=True) passes
    with pytest.raises(HubAccessError, match=refused.format("push to other/theirs")):
        upload_run(folder, "other/theirs", commit_message="m")
    assert list(hub.repos) == ["other/theirs"] and hub.pushes("other/theirs") == []


# ---- a DP model pushed, then loaded back by anyone with from_pretrained ----------------------------------------
def test_pushed_dp_gpt2_loads_back_with_from_pretrained_and_generates(tmp_path, hub, monkeypatch):
    from transformers import AutoModelForCausalLM

    args = DPTrainingArguments(output_dir=str(tmp_path / "run"), noise_multiplier=1.0, target_delta=1e-4, max_steps=2,
                               per_device_train_batch_size=8, report_to="none", save_strategy="no",
                               disable_tqdm=True, push_to_hub=True, hub_model_id="someone/dp-gpt2")
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=make_token_dataset(n=32))
    trainer.train()
    trainer.push_to_hub()
    assert hub.pushes("someone/dp-gpt2") == [["README.md", "config.json", "generation_config.json",
                                                "model.safetensors", "privacy_ledger.json"]]
    monkeypatch.delenv("HF_TOKEN")  # a public repository: anyone loads it
    loaded = AutoModelForCausalLM.from_pretrained("someone/dp-gpt2").eval()
    head = hub.repos["someone/dp-gpt2"].branches["main"]
    assert hub.calls("GET", f"/someone/dp-gpt2/resolve/{head}/model.safetensors")  # the pushed commit, from the Hub
    local = trainer.model.eval()
    assert local.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in local.state_dict().items())
    prompt = torch.tensor([[5, 17, 42]])
    greedy = dict(min_new_tokens=4, max_new_tokens=4, do_sample=False)  # 4 tokens even past an end-of-text token
    generated = loaded.generate(prompt, **greedy)
    assert generated.shape == (1, 7) and torch.equal(generated, local.generate(prompt, **greedy))


# ---- trainer.push_to_hub's keywords ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    args = DPTrainingArguments(output_dir=str(tmp_path_factory.mktemp("push")), noise_multiplier=1.0,
                               target_delta=1e-4, max_steps=1, per_device_train_batch_size=64, report_to="none",
                               save_strategy="no", disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(256)))
    trainer.train()
    return trainer


def test_push_to_hub_honours_hub_model_id_and_the_card_keywords(trained, hub):
    trained.push_to_hub(hub_model_id="someone/dp-vit", license="mit", tags=["vision", "dp"], language="en",
                        model_name="tiny ViT on digits", finetuned_from="google/vit-base-patch16-224",
                        dataset="someone/digits")
    assert list(hub.repos) == ["someone/dp-vit"]  # not output_dir's name
    card = ModelCard(hub.repos["someone/dp-vit"].files["README.md"].decode())
    assert card.data.license == "mit" and card.data.language == ["en"]
    assert {"vision", "dp", "differential-privacy"} <= set(card.data.tags)
    assert card.data.base_model == "google/vit-base-patch16-224" and card.data.datasets == ["someone/digits"]
    assert card.text.startswith("\n# tiny ViT on digits (DP-SGD")


@pytest.mark.parametrize("kwargs", [{"tasks": "image-classification"}, {"dataset_args": "x"}, {"licence": "mit"}])
def test_push_to_hub_refuses_keywords_the_dp_card_cannot_state_before_anything_is_sent(trained, kwargs, hub):
    info = trained.model_card_info
    with pytest.raises(TypeError, match=f"got \\['{next(iter(kwargs))}'\\]"):
        trained.push_to_hub(**kwargs)
    assert hub.requests == [] and hub.repos == {} and trained.model_card_info is info
