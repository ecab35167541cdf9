"""Every push, during and after training and from the CLI, sends exactly the allow-listed files: never the Trainer's
state, optimizer / RNG state, training_args.bin or a metric computed on the private data. Login and write access are
checked before any work. The Hub is mocked (test_model_card._Capture): the real upload_folder filtering runs."""

import json
import math
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from utils import HubCapture as _Capture

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main as cli_main
from hf_dp_repr.hub import HubAccessError, check_hub_access
from hf_dp_repr.model_card import format_epsilon
from hf_dp_repr.tiny import tiny_vit

WEIGHTS_LEDGER_CARD = ["README.md", "config.json", "model.safetensors", "privacy_ledger.json"]
AFTER_TRAINING = ["README.md", "all_results.json", "config.json", "model.safetensors", "privacy_ledger.json"]
# What a run leaves at the top of output_dir, or a user puts there, that must never be pushed.
DECOYS = ["training_args.bin", "trainer_state.json", "rng_state.pth", "rng_state_0.pth", "optimizer.pt",
          "scheduler.pt", "scaler.pt", "train_results.json", "run_info.json", "public_pretrained/model.safetensors",
          "public_pretrained/config.json", "runs/events.out.tfevents.1", "plots/private_train.png"]


def _no_nan(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not valid JSON: {c}"))


def _plant_decoys(folder: Path):
    for name in DECOYS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")


def _train(out: Path, digits, **hub):
    _plant_decoys(out)
    args = DPTrainingArguments(output_dir=str(out), target_epsilon=3.0, target_delta=1e-4, max_steps=4,
                               per_device_train_batch_size=32, learning_rate=1e-3, report_to="none",
                               save_strategy="steps", save_steps=2, disable_tqdm=True, push_to_hub=True,
                               hub_model_id="someone/dp-digits", hub_always_push=True, **hub)
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    trainer.model_card_info = {"private_data": "digits train split"}
    result = trainer.train()
    return trainer, result


def _push_after_training(trainer, result, hub):
    metrics = {**result.metrics, "eval_accuracy": 0.5, "epsilon": trainer.epsilon()}
    assert "train_loss" in metrics
    trainer.save_metrics("all", metrics, combined=False)  # as the recipes' finish_run does
    before = len(hub.commits)
    trainer.push_to_hub()
    assert hub.commits[before:] == [AFTER_TRAINING]
    sent = _no_nan(hub.files["all_results.json"].decode())
    assert not [k for k in sent if k.startswith("train_")] and {"epsilon", "epoch", "eval_accuracy"} <= set(sent)
    card = ModelCard(hub.files["README.md"].decode())
    assert "differential-privacy" in card.data.tags and "digits train split" in card.text
    ledger = json.loads(hub.files["privacy_ledger.json"])
    assert ledger["steps_done"] == 4 and f"**{format_epsilon(ledger['epsilon'])}**" in card.text


def test_every_save_pushes_weights_ledger_and_card_only(tmp_path, digits, monkeypatch):
    hub = _Capture(monkeypatch)
    trainer, result = _train(tmp_path, digits, hub_strategy="every_save")
    assert hub.whoami_calls == 1 and hub.repos == [("someone/dp-digits", None)]  # checked at DPTrainer(...)
    assert hub.commits == [WEIGHTS_LEDGER_CARD, WEIGHTS_LEDGER_CARD]  # the saves at steps 2 and 4
    assert json.loads(hub.files["privacy_ledger.json"])["steps_done"] in (2, 4)
    _push_after_training(trainer, result, hub)


def test_hub_strategy_end_pushes_once_after_training(tmp_path, digits, monkeypatch):
    hub = _Capture(monkeypatch)
    trainer, result = _train(tmp_path, digits, hub_strategy="end")
    assert hub.commits == []
    _push_after_training(trainer, result, hub)


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_hub_strategies_that_push_resumable_checkpoints_are_refused(strategy, tmp_path, digits, monkeypatch):
    with pytest.raises(ValueError, match=f"hub_strategy='{strategy}' pushes resumable checkpoints: "
                                         r"trainer_state.json .*Use hub_strategy='every_save'"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, push_to_hub=True, hub_strategy=strategy)
    DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, hub_strategy=strategy)  # not pushing: fine
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none")
    args.set_push_to_hub("someone/x", strategy=strategy)  # bypasses the arguments' own check
    hub = _Capture(monkeypatch)
    with pytest.raises(ValueError, match="resumable checkpoints"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    assert hub.repos == [] and hub.commits == []


def test_metrics_files_drop_train_keys_and_are_valid_json(tmp_path, digits):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, report_to="none")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    (tmp_path / "all_results.json").write_text(json.dumps({"train_loss": 0.1, "eval_accuracy": 0.3}))
    trainer.save_metrics("train", {"train_loss": 0.2, "train_runtime": 1.0, "epoch": 3.0, "epsilon": math.inf})
    assert _no_nan((tmp_path / "train_results.json").read_text()) == {"epoch": 3.0, "epsilon": None}
    assert _no_nan((tmp_path / "all_results.json").read_text()) == {"epoch": 3.0, "epsilon": None,
                                                                    "eval_accuracy": 0.3}


# ---- access is checked first -----------------------------------------------------------------------------------
def _whoami_raises(monkeypatch, err):
    from huggingface_hub import HfApi, constants

    def whoami(api, *a, **kw):
        raise err

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "whoami", whoami)


OFFLINE = r"push to someone/x: offline mode is on \(HF_HUB_OFFLINE=1\)\. Unset HF_HUB_OFFLINE; .*`hf-dp-repr push OUTPUT"


@pytest.mark.parametrize("err, message", [
    ("no_token", r"push to someone/x: not logged in to the Hugging Face Hub; log in with `hf auth login` or set HF_TOKEN"),
    ("offline", OFFLINE),
    ("dns", r"cannot reach the Hugging Face Hub \(ConnectError: \[Errno -2\] Name or service not known\)"),
])
def test_check_hub_access_names_the_fix(err, message, monkeypatch):
    from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

    if err == "dns":
        import httpx2

        error = httpx2.ConnectError("[Errno -2] Name or service not known")
    else:
        error = LocalTokenNotFoundError("no token") if err == "no_token" else OfflineModeIsEnabled("offline")
    _whoami_raises(monkeypatch, error)
    with pytest.raises(HubAccessError, match=message):
        check_hub_access("someone/x")


def test_check_hub_access_offline_says_so_before_asking_for_a_token(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(HubAccessError, match=OFFLINE):
        check_hub_access("someone/x")


def test_check_hub_access_needs_a_write_token_and_a_namespace_of_ours(monkeypatch):
    _Capture(monkeypatch, user="someone", role="read")
    with pytest.raises(HubAccessError, match="the token of someone is read-only; log in with `hf auth login`"):
        check_hub_access("someone/x")
    _Capture(monkeypatch, user="someone")
    with pytest.raises(HubAccessError, match=r"logged in as someone, .*not in 'other'\. Set --hub_model_id someone/x"):
        check_hub_access("other/x")
    assert check_hub_access("x") == "someone/x" and check_hub_access("someone/x") == "someone/x"


def test_recipe_checks_the_hub_before_any_work(tmp_path, monkeypatch):
    from huggingface_hub.errors import LocalTokenNotFoundError

    from hf_dp_repr.scripts import image_classification as image_recipe

    _whoami_raises(monkeypatch, LocalTokenNotFoundError("no token"))
    with pytest.raises(HubAccessError, match="hf auth login"):
        image_recipe.main(["--output_dir", str(tmp_path / "run"), "--target_epsilon", "1", "--max_steps", "1",
                           "--report_to", "none", "--push_to_hub", "true", "--hub_model_id", "someone/x"])
    assert not (tmp_path / "run").exists()  # no public pre-training, nothing written


def test_dp_trainer_with_push_to_hub_checks_access_at_construction(tmp_path, digits, monkeypatch):
    from huggingface_hub.errors import LocalTokenNotFoundError

    _whoami_raises(monkeypatch, LocalTokenNotFoundError("no token"))
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none", push_to_hub=True,
                               hub_model_id="someone/x")
    with pytest.raises(HubAccessError, match="hf auth login"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])


# ---- hf-dp-repr push OUTPUT_DIR ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("finished")
    args = DPTrainingArguments(output_dir=str(out), target_epsilon=3.0, target_delta=1e-4, max_steps=2,
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


def test_cli_push_sends_the_allow_list_with_a_card_refreshed_from_the_ledger(finished_run, tmp_path, monkeypatch,
                                                                             capsys):
    folder = _copy(finished_run, tmp_path / "run")
    ledger = json.loads((folder / "privacy_ledger.json").read_text())
    eps = f"**{format_epsilon(ledger['epsilon'])}**"
    stale = (folder / "README.md").read_text()
    assert eps in stale
    (folder / "README.md").write_text(stale.replace(eps, "**999**"))  # refreshed from the ledger below
    (folder / "representation_law.png").write_bytes(b"png")
    hub = _Capture(monkeypatch)
    assert cli_main(["push", str(folder), "--hub_model_id", "someone/pushed-later", "--private"]) == 0
    assert hub.whoami_calls == 1 and hub.repos == [("someone/pushed-later", True)]
    assert hub.commits == [["README.md", "all_results.json", "config.json", "model.safetensors", "privacy_ledger.json",
                            "representation_law.png"]]
    card = ModelCard(hub.files["README.md"].decode())
    assert eps in card.text and "**999**" not in card.text and "| eval_accuracy | 0.5 |" in card.text
    assert card.text == ModelCard.load(folder / "README.md").text
    assert card.text.lstrip().startswith("# tiny_vit fine-tuned on digits (DP-SGD, ε = ")
    assert "differential-privacy" in card.data.tags and "digits train split" in card.text  # kept from the old card
    assert "pushed README.md, all_results.json" in capsys.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("no_ledger", r"has no privacy_ledger.json; a DP model is never pushed without the record of its guarantee"),
    ("private_metric", r"all_results.json holds train_loss, computed on the private data"),
    ("no_weights", r"holds no model weights"),
    ("not_logged_in", r"not logged in to the Hugging Face Hub; log in with `hf auth login`"),
])
def test_cli_push_refuses_and_writes_nothing(case, message, finished_run, tmp_path, monkeypatch, capsys):
    folder = _copy(finished_run, tmp_path / "run")
    (folder / "README.md").unlink()  # a push that went through would write it
    hub = _Capture(monkeypatch)
    if case == "no_ledger":
        (folder / "privacy_ledger.json").unlink()
    elif case == "private_metric":
        (folder / "all_results.json").write_text(json.dumps({"train_loss": 0.3, "eval_accuracy": 0.5}))
    elif case == "no_weights":
        (folder / "model.safetensors").unlink()
    else:
        from huggingface_hub.errors import LocalTokenNotFoundError

        _whoami_raises(monkeypatch, LocalTokenNotFoundError("no token"))
    before = _snapshot(folder)
    with pytest.raises(SystemExit, match=message):
        cli_main(["push", str(folder), "--hub_model_id", "someone/x"])
    assert _snapshot(folder) == before and hub.repos == [] and hub.commits == []
