"""The card names the clipping engine that ran, and nothing pushed names a local path (issue 23, item 8): a base model
loaded from a local folder (the temporary folder of public pre-training) appears by its folder's name, said to be
local, in the card and in a LoRA run's adapter_config.json; `hf-dp-repr push --dry-run` previews the card."""

import json

import pytest
from huggingface_hub import ModelCard
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForImageClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main as cli_main
from hf_dp_repr.hub.card import refresh_model_card, render_model_card
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit
from utils import make_token_dataset

pytestmark = pytest.mark.usefixtures("one_thread")


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
