"""Settings that used to be silently wrong or fail late with a raw error are refused at once, naming the
argument and the fix, before anything is written."""

import math
import re

import pytest
from peft import LoraConfig

from hf_dp_repr import DPTrainer, DPTrainingArguments, PrivacyLedger
from hf_dp_repr.cli import main
from hf_dp_repr.privacy.accounting import compute_epsilon, epsilon_floor
from hf_dp_repr.scope.lora import apply_peft_config
from hf_dp_repr.tiny import tiny_vit


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


@pytest.mark.parametrize("value, message", [("inf", "--noise-multiplier 0"), ("nan", "NaN")])
def test_privacy_cli_refuses_an_infinite_target(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["privacy", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--target-epsilon", value])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "gradient_accumulation_steps",
                                  "lp_per_device_train_batch_size"])
def test_zero_batch_sizes_are_refused_by_name(name, tmp_path):
    extra = {"lp_steps": 0.5} if name.startswith("lp_") else {}
    with pytest.raises(ValueError, match=rf"DPTrainingArguments: {name}=0 must be >= 1"):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=1.0, report_to="none",
                            **{name: 0}, **extra)
    assert not (tmp_path / "never").exists()


def test_a_budget_below_the_accountants_floor_says_what_is_reachable(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), target_epsilon=1e-3, target_delta=1e-4,
                               per_device_train_batch_size=64, max_steps=50, report_to="none", disable_tqdm=True,
                               accountant="prv")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    with pytest.raises(ValueError, match=r"target_epsilon=0.001 .*'prv' accountant can certify") as e:
        trainer.train()
    message = str(e.value)
    floor = epsilon_floor(1e-4, 64 / len(digits["train"]), 50, "prv")
    assert f"ε = {floor:.4g}" in message and 1e-3 < floor
    reachable, sigma = re.search(r"target_epsilon=([\d.e-]+) takes σ = ([\d.e+]+[\d])", message).groups()
    spent = compute_epsilon([(float(sigma), 64 / len(digits["train"]), 50)], 1e-4, "prv")
    assert floor < spent <= float(reachable) * 1.001  # the suggestion is real (σ printed to 4 digits)
    assert "accountant='rdp' cannot certify it" in message
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]  # nothing written


def test_a_corrupted_ledger_names_the_file_and_what_to_do(digits, tmp_path):
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "privacy_ledger.json").write_text('{"accountant": "prv", "phases": [')
    with pytest.raises(ValueError, match=r"privacy_ledger.json is corrupted") as e:
        PrivacyLedger.load(str(checkpoint))
    assert str(checkpoint / "privacy_ledger.json") in str(e.value) and "earlier checkpoint" in str(e.value)
    (checkpoint / "privacy_ledger.json").write_text('{"accountant": "prv"}')  # valid JSON, fields missing
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, target_delta=1e-4, report_to="none")
    with pytest.raises(ValueError, match=r"checkpoint-3/privacy_ledger.json is corrupted \(KeyError"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"]).train(
            resume_from_checkpoint=str(checkpoint))


def test_lora_target_matching_nothing_with_modules_to_save_lists_the_candidates():
    model = tiny_vit()
    with pytest.raises(ValueError, match=r"DPTrainer: LoRA target modules \['query'\] match no layer") as e:
        apply_peft_config(model, LoraConfig(target_modules=["query"], modules_to_save=["classifier"]))
    assert "q_proj: 4 Linear" in str(e.value) and "fc1: 4 Linear" in str(e.value)


def test_privacy_cli_says_what_a_too_low_budget_would_need():
    with pytest.raises(SystemExit, match=r"hf-dp-repr privacy: target_epsilon=0.001 .*Reachable: target_epsilon="):
        main(["privacy", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--target-epsilon", "0.001",
              "--accountant", "prv"])  # pld certifies it (σ = 5120): prv has a floor
