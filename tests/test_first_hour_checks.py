"""Mistakes of the first hour refused with the product's own typed error before any work, naming what is wrong and
the fix: columns the model does not take, images of another size than the model's, a padding collator whose
tokenizer has no pad token."""

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.scripts.causal_lm import train_tokenizer
from hf_dp_repr.tiny import tiny_gpt2_classifier, tiny_vit
from hf_dp_repr.training.data_checks import check_image_size


def _trainer(tmp_path, model, dataset, **kwargs):
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), target_epsilon=8.0, target_delta=1e-4,
                               per_device_train_batch_size=8, max_steps=2, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    return DPTrainer(model=model, args=args, train_dataset=dataset, **kwargs)


def test_columns_the_model_does_not_take_name_the_rename_not_remove_unused_columns(tmp_path):
    train = load_digits_dataset()["train"].select(range(32))
    train = train.rename_column("pixel_values", "image").rename_column("labels", "target")
    trainer = _trainer(tmp_path, tiny_vit(), train)
    with pytest.raises(DPConfigError) as err:
        trainer.train()
    message = str(err.value)
    assert "columns ['image', 'target']" in message and "rename_column('<column>', 'pixel_values')" in message
    assert "No columns in the dataset match" not in message  # transformers' message, whose fix is the wrong one
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_vit_takes_images_of_another_size_but_not_other_channels(tmp_path):
    images = np.zeros((16, 1, 16, 16), dtype="float32")  # tiny_vit is configured for 1×8×8
    train = Dataset.from_dict({"pixel_values": images, "labels": [i % 10 for i in range(16)]}).with_format("torch")
    trainer = _trainer(tmp_path, tiny_vit(), train)
    trainer.train()  # a ViT interpolates its position embeddings (LeViT's refusal: test_pretrained_images)
    assert trainer.state.global_step > 0
    with pytest.raises(DPConfigError, match=r"images are \(3, 8, 8\)"):  # other channels are refused
        check_image_size(tiny_vit(), {"pixel_values": torch.zeros(2, 3, 8, 8)})
    check_image_size(tiny_vit(), {"pixel_values": torch.zeros(2, 1, 8, 8)})  # the model's size passes


def test_a_padding_collator_without_a_pad_token_is_refused_naming_the_token_fix(tmp_path):
    tokenizer = train_tokenizer(["a first text", "and a second one, longer"], vocab_size=300)
    tokenizer.pad_token = None  # as GPT-2's tokenizer ships
    rows = tokenizer(["a first text", "and a second one, longer"] * 8)
    train = Dataset.from_dict({**rows, "labels": [0, 1] * 8})
    model = tiny_gpt2_classifier(vocab_size=len(tokenizer))
    trainer = _trainer(tmp_path, model, train, data_collator=DataCollatorWithPadding(tokenizer))
    with pytest.raises(DPConfigError, match=r"has no pad token. Fix: `tokenizer.pad_token = tokenizer.eos_token` "
                                            r"\('<\|endoftext\|>'\)"):
        trainer.train()
    tokenizer.pad_token = tokenizer.eos_token  # the fix named: the probe batch now collates
    model.config.pad_token_id = tokenizer.pad_token_id
    from hf_dp_repr.training.data_checks import check_pad_token

    check_pad_token(DataCollatorWithPadding(tokenizer))


# ---- names that reach for the Hub: refused at once, naming what was looked for and where ----------------------------
NOBODY = "hf-dp-repr-nobody/no-such-repo"  # a Hub id that is in no cache


def test_a_hub_name_while_offline_fails_at_once_naming_where_it_looked(monkeypatch):
    from hf_dp_repr.data.hub_names import check_dataset_name, check_model_name
    from hf_dp_repr.errors import DataError, ModelFileError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=rf"--dataset_name '{NOBODY}': not found. Looked for a local folder .*, the "
                                        r"Hugging Face cache .* and not on the Hub: HF_HUB_OFFLINE is set.*digits"):
        check_dataset_name(NOBODY, shipped=("digits",))
    with pytest.raises(ModelFileError, match=r"HF_HUB_OFFLINE is set.*tiny_vit"):
        check_model_name(NOBODY, shipped=("tiny_vit",))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check_model_name("./", shipped=())  # an existing folder passes


def test_the_command_refuses_a_missing_dataset_or_model_in_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    from hf_dp_repr.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    for argv, says in ((["--dataset_name", "./no/such/folder"], "--dataset_name './no/such/folder': no such folder"),
                       (["--model_name_or_path", NOBODY], f"--model_name_or_path '{NOBODY}': not found")):
        code = main(["train", "image", "--output_dir", str(out), "--target_epsilon", "1", *argv])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and says in err, err
    assert not out.exists()


# ---- a hopeless budget: said before training, refused unless allowed ----------------------------------------------
def test_a_budget_whose_noise_dwarfs_the_signal_is_refused_naming_the_fixes_unless_allowed(tmp_path):
    from hf_dp_repr.training.plan import plan_run

    def args(**kw):
        return DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=0.01, target_delta=1e-5,
                                   per_device_train_batch_size=16, max_steps=4400, report_to="none", **kw)

    # (σ = 360.7, 22.5·C: the PLD grid follows q/σ; the 1e-3 grid had over-noised to σ ≈ 4700, 295·C: issue 38)
    with pytest.raises(DPConfigError, match=r"σ=36\d\.\d on an expected batch of 16 .* 22\.5·C.*Fixes: a larger "
                                            r"batch.*fewer steps.*larger target_epsilon; set allow_noise_dominated"):
        plan_run(args(), dataset_size=1437)
    assert plan_run(args(allow_noise_dominated=True), dataset_size=1437).phases[0].noise_multiplier > 300
    plan_run(DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, target_delta=1e-5, report_to="none",
                                 per_device_train_batch_size=16, max_steps=100), dataset_size=1437)  # a sane plan


def test_no_output_dir_says_where_the_run_goes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=rf"no output_dir given; .* go to {tmp_path}/trainer_output"):
        args = DPTrainingArguments(target_epsilon=1.0, report_to="none")
    assert args.output_dir == "trainer_output"


def test_the_card_says_why_epsilon_is_above_the_target_after_a_resume(tmp_path):
    from hf_dp_repr.hub.card import render_model_card
    from hf_dp_repr.privacy.ledger import PrivacyLedger
    from hf_dp_repr.training.plan import plan_run

    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-5, report_to="none",
                               per_device_train_batch_size=64, max_steps=20)
    plan = plan_run(args, dataset_size=1437)
    resumed = PrivacyLedger(plan, 20, ((5, 7),))  # killed after step 7, resumed from the checkpoint of step 4
    assert resumed.epsilon() > 8.0
    card = render_model_card(resumed.to_dict()).content
    assert ("ε is above the target ε = 8 because the run was interrupted and resumed: 3 noisy step(s) computed after "
            "its last checkpoint (steps 5-7) were lost and computed again with fresh noise") in card
    assert "interrupted" not in render_model_card(PrivacyLedger(plan, 20).to_dict()).content


def test_the_lora_path_prints_no_is_gradient_checkpointing_future_warning():
    import warnings

    from peft import LoraConfig

    from hf_dp_repr.scope.lora import apply_peft_config
    from hf_dp_repr.tiny import tiny_gpt2

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_peft_config(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"]))
        warnings.warn("`is_gradient_checkpointing` is deprecated (from elsewhere: still shown)", FutureWarning)
    shown = [str(w.message) for w in seen if "is_gradient_checkpointing" in str(w.message)]
    assert shown == ["`is_gradient_checkpointing` is deprecated (from elsewhere: still shown)"]


def test_a_recipe_refuses_delta_above_one_over_n_before_public_pretraining(tmp_path):
    """δ = 0.01 ≥ 1/n for the ~1150 private digits: refused by the recipe's checks before the public phase trains
    or writes anything, naming target_delta, n, the bound and the fix (issue 29, item 9)."""
    from hf_dp_repr.scripts import image_classification

    with pytest.raises(DPConfigError, match=r"target_delta=0.01 is >= 1/n = .* for n=\d+ training examples.*"
                                            r"allow_large_delta=True"):
        image_classification.main(["--output_dir", str(tmp_path / "out"), "--target_epsilon", "1",
                                   "--target_delta", "0.01", "--public_fraction", "0.2", "--max_steps", "2",
                                   "--report_to", "none", "--disable_tqdm", "true"])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
