"""Every TrainingArguments field is honoured, irrelevant or refused with the reason (issue 23, item 6): nothing the
Trainer takes is silently ignored under DP-SGD, and push_to_hub's keywords reach the push or are refused."""

import dataclasses

import pytest
from accelerate.parallelism_config import ParallelismConfig
from huggingface_hub import ModelCard
from transformers import TrainerCallback, TrainingArguments

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.tiny import tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

# A value of each refused field that DP-SGD cannot honour.
REFUSED_VALUES = {
    "train_sampling_strategy": "group_by_length", "dataloader_drop_last": True, "data_seed": 3,
    "optim": "galore_adamw_layerwise", "neftune_noise_alpha": 5.0, "torch_compile": True,
    "torch_compile_backend": "inductor", "torch_compile_mode": "max-autotune", "use_liger_kernel": True,
    "torch_empty_cache_steps": 10, "dataloader_in_order": False, "label_names": ["target"],
    "accelerator_config": {"split_batches": True}, "parallelism_config": ParallelismConfig(), "fsdp": "full_shard",
    "deepspeed": "ds_config.json", "auto_find_batch_size": True, "max_grad_norm": 1.0, "fp16": True,
    "hub_token": "hf_secret", "ignore_data_skip": True,
}


def test_every_trainer_field_has_a_decision():
    from hf_dp_repr.training.argument_fields import FIELDS

    names = [f.name for f in dataclasses.fields(TrainingArguments)]
    assert sorted(FIELDS) == sorted(names), set(names) ^ set(FIELDS)
    assert {f.decision for f in FIELDS.values()} == {"honoured", "irrelevant", "refused"}
    assert all(f.why for f in FIELDS.values())
    assert sorted(n for n, f in FIELDS.items() if f.decision == "refused") == sorted(REFUSED_VALUES)
    DPTrainingArguments(output_dir="never", target_epsilon=1.0, report_to="none")  # the defaults pass


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_each_refused_field_is_refused_by_name_before_anything_is_written(name, tmp_path):
    with pytest.raises(DPConfigError, match=rf"DPTrainingArguments: {name}=.* is refused under DP-SGD: ") as err:
        DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=1.0, report_to="none",
                            **{name: REFUSED_VALUES[name]})
    assert "hf_secret" not in str(err.value) and not (tmp_path / "never").exists()


@pytest.mark.parametrize("name, value", [("dataloader_drop_last", True), ("train_sampling_strategy", "group_by_length"),
                                         ("data_seed", 0)])
def test_a_field_set_after_the_arguments_were_built_is_refused_by_the_trainer(name, value, digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), target_epsilon=1.0, report_to="none")
    setattr(args, name, value)
    with pytest.raises(DPConfigError, match=f"{name}=.* is refused"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])


class _Loader(TrainerCallback):
    def on_train_begin(self, args, state, control, train_dataloader=None, **kw):
        self.loader = train_dataloader


def test_dataloader_options_reach_the_training_dataloader(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, target_delta=1e-4, max_steps=1,
                               per_device_train_batch_size=64, report_to="none", save_strategy="no", disable_tqdm=True,
                               dataloader_num_workers=1, dataloader_persistent_workers=True,
                               dataloader_prefetch_factor=3, dataloader_pin_memory=False)
    seen = _Loader()
    DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(256)), callbacks=[seen]).train()
    loader = seen.loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (1, True, 3)


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
