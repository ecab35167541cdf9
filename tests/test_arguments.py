"""`DPTrainingArguments` (training/arguments/: __init__, checks, fields). Every TrainingArguments
field is honoured, irrelevant or refused with the reason (issue 23, item 6): nothing the Trainer takes is silently
ignored under DP-SGD. A setting DP-SGD cannot take (a bad or non-finite budget, a zero batch size, fp16,
ignore_data_skip, hub_token, clipping='none' with noise, privacy_unit combinations) is refused at once, naming the
argument and the fix, before anything is written."""

import dataclasses
import math

import pytest
from accelerate.parallelism_config import ParallelismConfig
from transformers import TrainerCallback, TrainingArguments

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.tiny import tiny_vit
from utils import dp_args

# A value of each refused field that DP-SGD cannot honour.
REFUSED_VALUES = {
    "train_sampling_strategy": "group_by_length", "dataloader_drop_last": True, "data_seed": 3,
    "optim": "galore_adamw_layerwise", "neftune_noise_alpha": 5.0, "torch_compile": True,
    "torch_compile_backend": "inductor", "torch_compile_mode": "max-autotune", "use_liger_kernel": True,
    "torch_empty_cache_steps": 10, "dataloader_in_order": False, "label_names": ["target"],
    "accelerator_config": {"split_batches": True}, "parallelism_config": ParallelismConfig(),
    "deepspeed": "ds_config.json", "auto_find_batch_size": True, "max_grad_norm": 1.0, "fp16": True,
    "hub_token": "hf_secret", "ignore_data_skip": True, "include_num_input_tokens_seen": True,
}


def test_every_trainer_field_has_a_decision():
    from hf_dp_repr.training.arguments.fields import FIELDS

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


# ---- refused at once, naming the argument, before anything is written -----------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_epsilon": 0.0}, "target_epsilon must be > 0"),
        ({"target_epsilon": -1.0}, "target_epsilon must be > 0"),
        ({"target_epsilon": 1.0, "target_delta": 0.0}, "target_delta must be in"),
        ({"target_epsilon": 1.0, "target_delta": 1.0}, "target_delta must be in"),
        ({"target_epsilon": 1.0, "noise_multiplier": 1.0}, "target_epsilon and noise_multiplier are both set"),
        ({"target_epsilon": 1.0, "target_attack_tpr_at_fpr": "0.05@0.01"},
         "target_epsilon and target_attack_tpr_at_fpr are both set"),
        ({"noise_multiplier": 1.0, "target_attack_tpr_at_fpr": "0.05@0.01"},
         "target_attack_tpr_at_fpr and noise_multiplier are both set"),
        ({}, "none of target_epsilon, target_attack_tpr_at_fpr and noise_multiplier.*noise_multiplier=0"),
        ({"target_attack_tpr_at_fpr": "0.05"}, r"target_attack_tpr_at_fpr='0.05' is not a target 'TPR@FPR'"),
        ({"target_attack_tpr_at_fpr": "5%@1%"}, r"target_attack_tpr_at_fpr='5%@1%' is not a target 'TPR@FPR'"),
        ({"target_attack_tpr_at_fpr": "0.01@0.05"}, r"true-positive rate 0.01 must be in \(FPR, 1\)"),
        ({"target_attack_tpr_at_fpr": "0.5@0"}, r"false-positive rate 0 must be in \(0, 1\)"),
        ({"target_attack_tpr_at_fpr": "1@0.01"}, r"true-positive rate 1 must be in"),
        ({"target_attack_tpr_at_fpr": "0.05@0.01", "lp_steps": 0.5, "lp_epsilon_fraction": 0.2},
         "lp_epsilon_fraction splits target_epsilon"),
        ({"target_epsilon": 1.0, "per_sample_max_grad_norm": 0.0}, "per_sample_max_grad_norm must be > 0"),
        ({"target_epsilon": 1.0, "accountant": "moments"}, "unknown accountant 'moments'"),
        ({"target_epsilon": 1.0, "clipping": "adaptive"}, "unknown clipping"),
        ({"target_epsilon": 1.0, "max_grad_norm": 1.0}, "max_grad_norm"),
        ({"target_epsilon": 1.0, "auto_find_batch_size": True}, "auto_find_batch_size"),
    ],
)
def test_bad_arguments_raise_and_write_nothing(kwargs, message, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(output_dir=str(out), report_to="none", **kwargs)
    assert not out.exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"target_epsilon": math.inf}, r"target_epsilon=inf is no privacy budget.*noise_multiplier=0"),
    ({"target_epsilon": math.nan}, r"target_epsilon is NaN"),
    ({"noise_multiplier": math.nan}, r"noise_multiplier must be >= 0 and finite"),
    ({"noise_multiplier": math.inf}, r"noise_multiplier must be >= 0 and finite"),
])
def test_non_finite_budgets_are_refused(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), report_to="none", **kwargs)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "gradient_accumulation_steps",
                                  "lp_per_device_train_batch_size"])
def test_zero_batch_sizes_are_refused_by_name(name, tmp_path):
    extra = {"lp_steps": 0.5} if name.startswith("lp_") else {}
    with pytest.raises(ValueError, match=rf"DPTrainingArguments: {name}=0 must be >= 1"):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=1.0, report_to="none",
                            **{name: 0}, **extra)
    assert not (tmp_path / "never").exists()


def test_fp16_is_refused_and_points_to_bf16(tmp_path):
    with pytest.raises(ValueError, match=r"fp16=True.*GradScaler.*bf16=True"):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=8.0, fp16=True, report_to="none")
    assert not (tmp_path / "never").exists()


def test_ignore_data_skip_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ignore_data_skip=True would replay"):
        dp_args(tmp_path, ignore_data_skip=True)


def test_hub_token_in_arguments_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hub_token would be pickled.*HF_TOKEN"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, hub_token="hf_x")


@pytest.mark.parametrize("budget", [{"noise_multiplier": 1.0}, {"target_epsilon": 8.0}])
def test_unclipped_is_refused_with_any_noise(budget, tmp_path):
    with pytest.raises(DPConfigError, match="clipping='none' bounds no example's influence"):
        DPTrainingArguments(output_dir=str(tmp_path), clipping="none", report_to="none", **budget)


@pytest.mark.parametrize("kw, match", [
    (dict(privacy_unit="user_id", poisson_sampling=False), "needs poisson_sampling=True"),
    (dict(privacy_unit="user_id", cache_features=True), "cache_features=True with privacy_unit"),
    (dict(max_rows_per_unit=3), "max_rows_per_unit is set but privacy_unit='row'"),
    (dict(privacy_unit="user_id", max_rows_per_unit=0), "max_rows_per_unit=0 must be >= 1"),
    (dict(privacy_unit=""), "privacy_unit='' must be"),
])
def test_unsupported_combinations_are_refused(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none", **kw)


def test_attack_target_reaches_the_recipes_through_yaml_and_flags(tmp_path):
    """target_attack_tpr_at_fpr is a DPTrainingArguments field: a recipe's --config YAML and its command line set it
    (the flag overriding the file), and a bad value is refused by name before any work."""
    from hf_dp_repr.scripts.arguments import ScriptArguments, parse_args

    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\ntarget_attack_tpr_at_fpr: 0.05@0.01\nreport_to: [none]\n")
    _, args = parse_args((ScriptArguments, DPTrainingArguments), ["--config", str(config)])
    assert args.target_attack_tpr_at_fpr == "0.05@0.01" and args.target_epsilon is None
    _, args = parse_args((ScriptArguments, DPTrainingArguments),
                         ["--config", str(config), "--target_attack_tpr_at_fpr", "0.1@0.001"])
    assert args.target_attack_tpr_at_fpr == "0.1@0.001"
    with pytest.raises(DPConfigError, match="target_attack_tpr_at_fpr and noise_multiplier are both set"):
        parse_args((ScriptArguments, DPTrainingArguments), ["--config", str(config), "--noise_multiplier", "1"])
    assert not (tmp_path / "out").exists()
