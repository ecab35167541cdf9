"""A training set the model cannot read is refused by DPTrainer before any work (issue 23, item 4): columns named for
another model, string labels, labels outside the model's classes; a truncated weights file names itself."""

import pytest
import torch
from datasets import ClassLabel, Value

from hf_dp_repr import DPTrainer, DPTrainingArguments, errors
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.data_checks import check_train_inputs


def _args(tmp_path, **kw):
    return DPTrainingArguments(output_dir=str(tmp_path / "out"), target_epsilon=8.0, target_delta=1e-4,
                               per_device_train_batch_size=64, max_steps=1, report_to="none", disable_tqdm=True,
                               save_strategy="no", **kw)


def _nothing_written(tmp_path):
    return not [p for p in tmp_path.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def train(digits):
    return digits["train"].select(range(200))


def test_columns_named_for_another_model_are_refused_when_train_starts_with_the_rename(train, tmp_path):
    hub_style = train.rename_column("pixel_values", "image").rename_column("labels", "label")
    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=hub_style)
    with pytest.raises(DPConfigError) as err:
        trainer.train()
    message = str(err.value)
    assert "columns ['image', 'label']" in message and "ViTForImageClassification.forward takes pixel_values" in message
    assert "rename_column('image', 'pixel_values')" in message
    assert trainer.ledger is None and _nothing_written(tmp_path)


def test_a_dataset_swapped_after_init_is_checked_when_train_starts(train, tmp_path):
    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=train)
    trainer.train_dataset = train.rename_column("labels", "target")
    with pytest.raises(DPConfigError, match=r"no `labels`.*rename_column\('target', 'labels'\)"):
        trainer.train()
    assert trainer.ledger is None and _nothing_written(tmp_path)


def test_a_collator_that_builds_the_input_from_another_column_passes(train, tmp_path):
    raw = train.rename_column("pixel_values", "image").with_format("torch")

    def collate(rows):
        return {"pixel_values": torch.stack([r["image"] for r in rows]),
                "labels": torch.stack([r["labels"] for r in rows])}

    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path, remove_unused_columns=False), train_dataset=raw,
                        data_collator=collate)
    check_train_inputs(trainer)  # what train() runs first: the probe batch has what forward reads, no error


def test_string_labels_are_refused_with_class_encode_column(train, tmp_path):
    named = train.cast_column("labels", Value("int64")).map(lambda r: {"labels": f"digit {r['labels']}"})
    with pytest.raises(DPConfigError, match=r"`labels` column holds strings.*class_encode_column\('labels'\)"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=named)
    rows = [{"pixel_values": torch.zeros(1, 8, 8), "labels": "cat"}] * 4  # a plain map-style dataset of dicts
    with pytest.raises(DPConfigError, match="holds strings.*map each class name to an id"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=rows)
    assert _nothing_written(tmp_path)


def test_labels_outside_num_labels_name_the_largest_and_the_fix(train, tmp_path):
    shifted = train.cast_column("labels", Value("int64")).map(lambda r: {"labels": r["labels"] + 10})
    with pytest.raises(DPConfigError, match=r"class id 19 but ViTForImageClassification has config.num_labels=10 "
                                            r"\(ids 0..9\); load the model with num_labels=20"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=shifted)
    wide = train.cast_column("labels", ClassLabel(num_classes=100))
    with pytest.raises(DPConfigError, match="ClassLabel of 100 classes .* num_labels=10"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=wide)
    assert _nothing_written(tmp_path)
    # -100 (the ignored label) passes, and only the rows of a selection count, not the whole table behind it
    half = train.cast_column("labels", Value("int64")).map(
        lambda r, i: {"labels": -100 if i == 0 else r["labels"] + (10 if i >= 100 else 0)}, with_indices=True)
    DPTrainer(model=tiny_vit(), args=_args(tmp_path), train_dataset=half.select(range(100)))


def test_a_truncated_safetensors_file_is_named_with_the_fix(tmp_path):
    folder = tmp_path / "vit"
    tiny_vit().save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    out = tmp_path / "out"
    with pytest.raises(errors.ModelFileError) as err:
        image_recipe.main(["--model_name_or_path", str(folder), "--output_dir", str(out), "--target_epsilon", "8",
                           "--report_to", "none"])
    message = str(err.value)
    assert f"cannot read {weights} (100 bytes)" in message and "invalid header length" in message
    assert "truncated or corrupted" in message and "save or copy the model again" in message
    assert isinstance(err.value, OSError) and not out.exists()


class _FeatureProbe(torch.nn.Module):
    """A plain torch module (no `main_input_name`), as a linear probe on cached features is."""

    def __init__(self):
        super().__init__()
        self.classifier = torch.nn.Linear(4, 3)

    def forward(self, features, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(features)
        return SequenceClassifierOutput(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def test_a_plain_module_is_checked_against_its_own_forward_inputs(tmp_path):
    from datasets import Dataset

    rows = Dataset.from_dict({"features": torch.randn(40, 4).tolist(), "labels": [i % 3 for i in range(40)]})
    trainer = DPTrainer(model=_FeatureProbe(), args=_args(tmp_path), train_dataset=rows.with_format("torch"))
    check_train_inputs(trainer)  # seen failing before: "the collated batch has no `input_ids`"
    trainer.train_dataset = rows.rename_column("features", "x").with_format("torch")
    with pytest.raises(DPConfigError, match=r"_FeatureProbe.forward takes features, labels.*no `features`"):
        check_train_inputs(trainer)
