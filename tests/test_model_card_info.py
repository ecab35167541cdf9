"""Model card inputs are a declared argument of DPTrainer (`model_card_info=ModelCardInfo(...)`), written into the
card from one place (model_card.write_model_card) and kept in its metadata."""

import pytest
from huggingface_hub import ModelCard

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.hub.card import ModelCardInfo, write_model_card
from hf_dp_repr.tiny import tiny_vit


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
