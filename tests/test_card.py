"""The DP model card (hub/card.py): it states the run's facts, and the Hub push sends exactly the DP run's files;
its inputs are a declared argument of DPTrainer (`model_card_info=ModelCardInfo(...)`) kept in its metadata; it names
the clipping engine that ran, and nothing pushed names a local path (issue 23, item 8): a base model loaded from a
local folder appears by its folder's name in the card and in a LoRA run's adapter_config.json; `hf-dp-repr push
--dry-run` previews the card."""

import json
import math

import pytest
from huggingface_hub import ModelCard
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForImageClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main as cli_main
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.hub import push_dp_model
from hf_dp_repr.hub.card import (
    ModelCardInfo,
    format_epsilon,
    refresh_model_card,
    render_model_card,
    template_path,
    write_model_card,
)
from hf_dp_repr.privacy.accounting import compute_epsilon
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import make_token_dataset


def _ledger(**over):
    history = [[1.25, 0.05, 200]]
    led = dict(accountant="pld", target_delta=1e-5, per_sample_max_grad_norm=0.5, clipping="per_layer",
               dataset_size=1280, poisson_sampling=True, target_epsilon=4.0, world_size=2, neighboring="replace_one",
               phases=[dict(name="train", noise_multiplier=1.25, sample_rate=0.05, steps=200, expected_batch_size=64)],
               history=history, steps_done=200, planned_steps=200)
    led.update(over)
    led["epsilon"] = compute_epsilon([tuple(h) for h in led["history"]], led["target_delta"], led["accountant"],
                                     led.get("neighboring", "add_remove"))
    return led


def _law_file(tmp_path):
    fit = {"rho": 0.4321, "intercept": 1.0, "r": -0.987, "layers": [0, 1, 2, 3, 4]}
    res = {"rho": 0.8765, "intercept": 0.0, "r": -0.95, "layers": [1, 2, 3, 4]}
    (tmp_path / "representation_law.json").write_text(json.dumps({"analyses": [
        {"event": "train_end", "step": 200, "epoch": 10, "fuzziness_law": fit, "residual_law": res}]}))
    (tmp_path / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.9123, "eval_runtime": 1.5,
                                                           "train_loss": 0.3, "epsilon": 2.5}))


def test_card_states_the_guarantee_data_scope_versions_and_laws(tmp_path):
    _law_file(tmp_path)
    led = _ledger()
    card = render_model_card(led, scope="last 2 of 4 blocks + head (classifier)", output_dir=tmp_path,
                             model_card_info={"private_data": "PRIVATE-SET-XYZ", "public_data": "PUBLIC-SET-ABC",
                                              "base_model": "google/vit-base-patch16-224-in21k",
                                              "datasets": ["cifar10"]})
    text = card.text
    eps = format_epsilon(led["epsilon"])
    assert f"**{eps}**" in text and f"(ε = {eps}, δ = 1e-05)-differentially private" in text
    for fact in ("| δ | 1e-05 |", "| target ε | 4 |", "pld (dp_accounting)", "| noise multiplier σ | 1.25 |",
                 "| per-example clipping norm C | 0.5 (per_layer clipping) |",
                 "Poisson batches, sample rate q = 0.05 (expected logical batch 64)",
                 "| steps taken / planned | 200 / 200 |",
                 "| epochs, as the Trainer counts them | 10 |", "| expected passes over the data (Σ q × steps) | 10 |",
                 "| private training examples (n) | 1280 |", "| processes | 2 |",
                 "PRIVATE-SET-XYZ", "PUBLIC-SET-ABC", "last 2 of 4 blocks + head (classifier)",
                 "google/vit-base-patch16-224-in21k", "| eval_accuracy | 0.9123 |",
                 "| separation fuzziness D_l | 0.4321 | -0.987 | 0..4 |",
                 "| prediction residual PR_l | 0.8765 | -0.95 | 1..4 |"):
        assert fact in text, fact
    import opacus
    import torch
    import transformers

    for lib in (torch, transformers, opacus):
        assert f"- {lib.__name__} {lib.__version__}" in text
    assert "eval_runtime" not in text and "train_loss" not in text  # timings, and a loss on private data
    assert "NOT differentially private" not in text and "### Phases" not in text
    assert "differential-privacy" in card.data.tags
    assert card.data.base_model == "google/vit-base-patch16-224-in21k" and card.data.datasets == ["cifar10"]
    assert ModelCard(str(card)).data.tags == card.data.tags  # the metadata block round-trips


def test_card_of_a_two_phase_run_has_a_phase_table(tmp_path):
    phases = [dict(name="linear_probe", noise_multiplier=2.0, sample_rate=0.1, steps=30, expected_batch_size=128),
              dict(name="fine_tune", noise_multiplier=3.5, sample_rate=0.05, steps=70, expected_batch_size=64)]
    led = _ledger(phases=phases, history=[[2.0, 0.1, 30], [3.5, 0.05, 70]], steps_done=100, planned_steps=100)
    text = render_model_card(led).text
    assert "### Phases" in text and "per phase, see the table below" in text
    assert "| linear_probe | 2 | 0.1 | 128 | 30 |" in text and "| fine_tune | 3.5 | 0.05 | 64 | 70 |" in text
    assert "| expected passes over the data (Σ q × steps) | 6.5 |" in text  # 30·0.1 + 70·0.05
    assert "| epochs, as the Trainer counts them | 5 |" in text  # 100 steps of ⌊1280 / 64⌋ = 20


def test_card_of_a_legacy_scalar_ledger(tmp_path):
    led = _ledger()
    del led["phases"]
    led.update(noise_multiplier=1.25, sample_rate=0.05, expected_batch_size=64)
    assert "| noise multiplier σ | 1.25 |" in render_model_card(led).text


def test_non_private_and_non_poisson_runs_are_flagged():
    led = _ledger(history=[[0.0, 0.05, 200]],
                  phases=[dict(name="train", noise_multiplier=0.0, sample_rate=0.05, steps=200,
                               expected_batch_size=64)])
    assert math.isinf(led["epsilon"])
    text = render_model_card(led).text
    assert "NOT differentially private (ε = ∞)" in text and "-differentially private." not in text
    text = render_model_card(_ledger(poisson_sampling=False)).text
    assert "is **not** a proven guarantee" in text and "shuffled fixed-size batches" in text


def _non_private_ledger():
    q = 128 / 1006  # the demo's reference run: 1006 private examples, logical batch 128, 30 epochs of 7 steps
    return _ledger(history=[[0.0, q, 210]], target_epsilon=None, dataset_size=1006, steps_done=210,
                   planned_steps=210, phases=[dict(name="train", noise_multiplier=0.0, sample_rate=q, steps=210,
                                                   expected_batch_size=128)])


def test_card_of_a_non_private_reference_says_what_it_is():
    from hf_dp_repr.hub.card import NON_PRIVATE_TAGS

    card = render_model_card(_non_private_ledger(), model_card_info={"model_name": "tiny_vit fine-tuned on digits"})
    text = card.text
    assert text.lstrip().startswith("# tiny_vit fine-tuned on digits: non-private reference\n")
    assert card.data.tags == NON_PRIVATE_TAGS and not {"differential-privacy", "dp-sgd", "opacus"} & set(card.data.tags)
    assert ModelCard(str(card)).data.tags == NON_PRIVATE_TAGS
    assert "NOT differentially private (ε = ∞)" in text and "**no noise**" in text
    for claim in ("differentially private SGD", "DP-SGD", "DP fine-tuned", "Privacy guarantee", "trained under DP",
                  "-differentially private."):
        assert claim not in text, claim
    assert render_model_card(_non_private_ledger()).text.lstrip().startswith("# Non-private reference model\n")
    private = render_model_card(_ledger(), model_card_info={"model_name": "tiny_vit fine-tuned on digits"})
    assert private.text.lstrip().startswith("# tiny_vit fine-tuned on digits (DP-SGD, ε = ")


def test_card_gives_the_trainers_epochs_and_the_expected_passes_with_the_reason():
    text = render_model_card(_non_private_ledger()).text
    assert "(30 epochs as the Trainer counts them,\n26.72 expected passes over the data)" in text
    assert "the Trainer counts ⌊n / batch⌋ = 7 steps (logical batch 128) as an epoch" in text
    assert "Σ q × steps =\n26.72; the two differ when n is not a multiple of the batch" in text
    q = 128 / 1006
    text = render_model_card(_ledger(history=[[1.0, q, 210]], dataset_size=1006, steps_done=210, planned_steps=210,
                                     phases=[dict(name="train", noise_multiplier=1.0, sample_rate=q, steps=210,
                                                  expected_batch_size=128)])).text
    assert "| epochs, as the Trainer counts them | 30 |" in text
    assert "| expected passes over the data (Σ q × steps) | 26.72 |" in text


def test_card_states_how_the_noise_was_drawn_and_the_neighbouring_relation():
    led = _ledger(accountant="rdp", neighboring="add_remove")
    del led["neighboring"]  # ledgers without the fields: OS entropy, add/remove
    text = render_model_card(led).text
    assert "| noise and batch sampling | drawn from OS entropy (no seed reproduces them) |" in text
    assert ("| neighbouring relation | add/remove one example for the plan's ε, which needs n secret; replace one "
            "example for the guarantee above |") in text
    assert "Not private as released" not in text
    text = render_model_card(_ledger(randomness="seeded")).text
    assert ("| noise and batch sampling | seeded with noise_seed: NOT private, anyone who knows the seed can remove "
            "the noise |") in text
    assert "| neighbouring relation | replace one example (n is public: this card states it) |" in text
    assert "**Not private as released:**" in text.split("## Privacy guarantee")[0]  # said under the title


def test_template_is_the_one_in_model_cards():
    from pathlib import Path

    shipped = Path(template_path())
    root = Path(__file__).resolve().parents[1]
    assert shipped.read_text() == (root / "model_cards" / "dp_model_card.md").read_text()
    # one file: the package ships it through a symbolic link, not a second copy to keep in step
    assert [p.name for p in (root / "hf_dp_repr").rglob("*.md") if not p.is_symlink()] == []


# ---- a real run: the card at every save, and the push ----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("card_run")
    args = DPTrainingArguments(output_dir=str(out), target_epsilon=3.0, target_delta=1e-4, max_steps=3,
                               per_device_train_batch_size=32, learning_rate=1e-3, report_to="none",
                               save_strategy="steps", save_steps=3, disable_tqdm=True)
    data = load_digits_dataset()
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=data["train"])
    trainer.model_card_info = {"private_data": "digits train split"}
    trainer.train()
    trainer.save_model()
    return trainer, out


def test_every_save_writes_the_card_next_to_the_ledger(trained):
    trainer, out = trained
    for folder in (out, out / "checkpoint-3"):
        card = ModelCard.load(folder / "README.md")
        ledger = json.loads((folder / "privacy_ledger.json").read_text())
        assert f"**{format_epsilon(ledger['epsilon'])}**" in card.text and "digits train split" in card.text
        assert "differential-privacy" in card.data.tags
        assert f"| epochs, as the Trainer counts them | {trainer.state.epoch:.4g} |" in card.text
    assert write_model_card(trainer, out).text == ModelCard.load(out / "README.md").text


def test_card_refreshed_from_the_folder_alone_keeps_what_the_caller_said(trained, tmp_path):
    import shutil

    from hf_dp_repr.hub.card import refresh_model_card

    trainer, out = trained
    folder = tmp_path / "copy"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    before = (folder / "README.md").read_text()
    assert refresh_model_card(folder).text == ModelCard(before).text and "digits train split" in before
    (folder / "privacy_ledger.json").write_text("{not json")
    with pytest.raises(ValueError, match="privacy_ledger.json is not valid JSON"):
        refresh_model_card(folder)


def test_push_sends_weights_metrics_laws_ledger_and_card_only(trained, hub, capsys):
    trainer, out = trained
    _law_file(out)
    (out / "representation_law.png").write_bytes(b"png")
    token = b"hf_write_someone"  # the HF_TOKEN the push uses (the hub fixture's)
    trainer.args.hub_model_id = "someone/dp-digits"
    card_before = (out / "README.md").read_bytes()
    with pytest.raises(ValueError, match="all_results.json holds train_loss, computed on the private data"):
        push_dp_model(trainer)  # an all_results.json not written by DPTrainer.save_metrics
    assert hub.repos == {} and (out / "README.md").read_bytes() == card_before
    (out / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.9123, "eval_runtime": 1.5, "epsilon": 2.5}))
    push_dp_model(trainer)
    assert not hub.repos["someone/dp-digits"].private and hub.calls("POST", "/api/validate-yaml")
    assert hub.pushes("someone/dp-digits") == [["README.md", "all_results.json", "config.json", "model.safetensors",
                                                "privacy_ledger.json", "representation_law.json",
                                                "representation_law.png"]]
    card = ModelCard.load("someone/dp-digits")  # from the Hub
    assert "differential-privacy" in card.data.tags and "| eval_accuracy | 0.9123 |" in card.text
    assert json.loads(hub.repos["someone/dp-digits"].files["privacy_ledger.json"])["steps_done"] == 3
    printed = capsys.readouterr()
    assert token.decode() not in printed.out + printed.err
    for path in out.rglob("*"):
        if path.is_file():
            assert token not in path.read_bytes(), path
    assert not [name for name, data in hub.repos["someone/dp-digits"].files.items() if token in data]


def test_trainer_push_to_hub_sends_the_dp_card_through_the_allow_list(trained, hub):
    trainer, out = trained
    trainer.args.hub_model_id = "someone/dp-digits-2"
    trainer.create_model_card(model_name="x")  # the Trainer's generic card must not replace the DP card
    assert "differential-privacy" in ModelCard.load(out / "README.md").data.tags
    trainer.push_to_hub(commit_message="test push")
    repo = hub.repos["someone/dp-digits-2"]
    assert repo.commits[-1].title == "test push"
    assert "training_args.bin" not in repo.files and "privacy_ledger.json" in repo.files
    assert "differential-privacy" in ModelCard.load("someone/dp-digits-2").data.tags


# ---- the card's declared inputs (model_card_info) -------------------------------------------------------------------
def _trainer(tmp_path, digits, **kw):
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-4, max_steps=1,
                               per_device_train_batch_size=64, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    return DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"], **kw)


def test_declared_card_info_reaches_the_card_and_its_metadata(tmp_path, digits):
    info = ModelCardInfo(model_name="tiny_vit fine-tuned on digits", private_data="PRIVATE-DIGITS-XYZ",
                         public_data="PUBLIC-NOTHING-ABC", datasets=("someone/digits",), license="apache-2.0")
    trainer = _trainer(tmp_path, digits, model_card_info=info)
    assert trainer.model_card_info is info
    trainer.train()
    card = write_model_card(trainer, tmp_path)
    assert "PRIVATE-DIGITS-XYZ" in card.text and "PUBLIC-NOTHING-ABC" in card.text
    loaded = ModelCard.load(tmp_path / "README.md").data.to_dict()
    assert loaded["license"] == "apache-2.0" and loaded["datasets"] == ["someone/digits"]
    assert loaded["hf_dp_repr"]["info"]["private_data"] == "PRIVATE-DIGITS-XYZ"


def test_a_dict_is_accepted_and_an_unknown_field_refused(tmp_path, digits):
    assert ModelCardInfo.from_value({"private_data": "x", "datasets": ["a/b"]}) == ModelCardInfo(
        private_data="x", datasets=("a/b",))
    assert _trainer(tmp_path, digits).model_card_info == ModelCardInfo()
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['privat_data'\]"):
        _trainer(tmp_path, digits, model_card_info={"privat_data": "typo"})


# ---- provenance: the engine that ran, and no local path -------------------------------------------------------------
def _args(out, **kw):
    return DPTrainingArguments(output_dir=str(out), noise_multiplier=1.0, target_delta=1e-3, max_steps=1,
                               per_device_train_batch_size=16, report_to="none", save_strategy="no",
                               disable_tqdm=True, **kw)


@pytest.fixture(scope="module")
def local_base_run(digits, tmp_path_factory):
    """A ViT 'pre-trained' into a local folder, reloaded by its absolute path, DP fine-tuned and saved."""
    root = tmp_path_factory.mktemp("secret-home-dir")
    base = root / "public_pretrained"
    tiny_vit().save_pretrained(base)
    model = AutoModelForImageClassification.from_pretrained(str(base))
    out = root / "run"
    trainer = DPTrainer(model=model, args=_args(out, clipping_engine="ghost"),
                        train_dataset=digits["train"].select(range(64)))
    trainer.train()
    trainer.save_model()
    return root, out, trainer


def test_the_card_names_the_engine_that_ran(local_base_run):
    root, out, trainer = local_base_run
    assert trainer.clipping_engine == "ghost"
    for card in (ModelCard.load(out / "README.md"), refresh_model_card(out, write=False)):
        assert "ghost norms and book-keeping" in card.text and "Opacus per-example clipping" not in card.text
    hooks = render_model_card(trainer.ledger.to_dict(), engine="hooks")  # as write_model_card passes it
    assert "per-example clipping on Opacus' per-sample gradient hooks" in hooks.text


def test_a_local_base_model_is_named_by_its_folder_never_its_path(local_base_run):
    root, out, _ = local_base_run
    for text in ((out / "README.md").read_text(), refresh_model_card(out, write=False).content):
        assert str(root) not in text and "secret-home-dir" not in text
        assert "Base model: public_pretrained (a local folder, not a Hub model)" in text
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # the Hub metadata names Hub models only
    assert card.data.to_dict()["hf_dp_repr"]["base_model_local"] is True
    info = {"private_data": f"1006 rows of {root}/data/cifar.npz", "datasets": [f"{root}/data/cifar.npz", "cifar10"]}
    card = render_model_card(json.loads((out / "privacy_ledger.json").read_text()), model_card_info=info)
    assert card.data.datasets == ["cifar10"] and "1006 rows of cifar.npz" in card.text and str(root) not in card.content


def test_lora_adapter_config_names_no_local_path(tmp_path):
    base = tmp_path / "my-base"
    tiny_gpt2().save_pretrained(base)
    out = tmp_path / "adapters"
    trainer = DPTrainer(model=AutoModelForCausalLM.from_pretrained(str(base)), args=_args(out),
                        train_dataset=make_token_dataset(n=32),
                        peft_config=LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    trainer.save_model()  # what every save (and checkpoint) of a LoRA run writes; no training needed to see it
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "my-base" and str(tmp_path) not in json.dumps(config)


def test_push_dry_run_prints_the_card_and_files_and_sends_nothing(local_base_run, hub, capsys):
    _, out, _ = local_base_run
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert cli_main(["push", str(out), "--hub_model_id", "me/dp-vit", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "(ε = " in printed and "ghost norms" in printed and "differential-privacy" in printed
    assert "would push README.md, config.json, model.safetensors, privacy_ledger.json to me/dp-vit" in printed
    assert hub.requests == [] and hub.repos == {}  # no login check, no repository, no commit
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
