"""Plan vs ledger (issue 14, item 10; privacy/ledger.py, training/plan.py): a frozen `PrivacyPlan` of what the run
will do, and a `PrivacyLedger` of how far it got, with the ledger file of every checkpoint unchanged. The ledger
steps through its phases and never past them, is computed before its file is opened, and a corrupted one is named."""

import dataclasses
import json

import pytest

from hf_dp_repr import DPTrainer, DPTrainingArguments, PrivacyLedger, PrivacyPlan
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.privacy.accounting import (
    compute_epsilon,
)
from hf_dp_repr.privacy.ledger import Phase
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.plan import plan_run, resume_ledger

# privacy_ledger.json as the code before the split wrote it (3 of 5 steps of a linear probe then a fine-tune).
OLD_LEDGER = """{
  "accountant": "rdp",
  "target_delta": 1e-05,
  "per_sample_max_grad_norm": 1.0,
  "clipping": "flat",
  "dataset_size": 100,
  "poisson_sampling": true,
  "phases": [
    {
      "name": "linear_probe",
      "noise_multiplier": 2.0,
      "sample_rate": 0.2,
      "steps": 2,
      "expected_batch_size": 20
    },
    {
      "name": "fine_tune",
      "noise_multiplier": 1.0,
      "sample_rate": 0.1,
      "steps": 3,
      "expected_batch_size": 10
    }
  ],
  "target_epsilon": 4.0,
  "world_size": 1,
  "neighboring": "add_remove",
  "randomness": "os-entropy",
  "privacy_unit": "row",
  "history": [
    [
      2.0,
      0.2,
      2
    ],
    [
      1.0,
      0.1,
      1
    ]
  ],
  "steps_done": 3,
  "planned_steps": 5,
  "epsilon": 2.2173110063347,
  "epsilon_by_phase": {
    "linear_probe": 1.0365030594575946,
    "fine_tune": 2.133005995430793
  }
}"""


def _plan(**changes) -> PrivacyPlan:
    plan = PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
                       dataset_size=100, poisson_sampling=True, target_epsilon=4.0,
                       phases=[Phase("linear_probe", 2.0, 0.2, 2, 20), Phase("fine_tune", 1.0, 0.1, 3, 10)])
    return dataclasses.replace(plan, **changes)


def test_a_ledger_written_before_the_split_loads_and_is_written_back_byte_for_byte(tmp_path):
    (tmp_path / "privacy_ledger.json").write_text(OLD_LEDGER)
    ledger = PrivacyLedger.load(str(tmp_path))
    assert ledger == PrivacyLedger(_plan(), steps_done=3)
    assert ledger.history == [(2.0, 0.2, 2), (1.0, 0.1, 1)] and ledger.phase_index() == 1
    out = tmp_path / "again"
    out.mkdir()
    ledger.save(str(out))
    assert (out / "privacy_ledger.json").read_text() == OLD_LEDGER


def test_the_plan_is_frozen_and_the_ledger_only_counts_steps():
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.target_delta = 1e-3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.phases[0].noise_multiplier = 0.0
    assert not hasattr(plan, "record_step") and not hasattr(plan, "steps_done")
    ledger = PrivacyLedger(plan)
    for _ in range(3):
        ledger.record_step()
    assert ledger.plan == _plan() and ledger.steps_done == 3  # stepping the ledger leaves its plan as it was
    assert ledger.epsilon() == plan.epsilon(3) < plan.planned_epsilon() == ledger.plan.planned_epsilon()
    # the plan's fields are ledger.plan's; reading them through the ledger still works, with a DeprecationWarning
    with pytest.warns(DeprecationWarning, match=r"use ledger\.plan\.target_delta"):
        assert ledger.target_delta == 1e-5
    with pytest.warns(DeprecationWarning, match=r"use ledger\.plan\.phases"):
        assert ledger.phases is plan.phases
    with pytest.raises(AttributeError):
        ledger.no_such_field  # noqa: B018
    with pytest.raises(AttributeError):
        ledger.target_delta = 1e-3  # only the plan says what the run does
    with pytest.raises(ValueError, match="outside the plan"):
        PrivacyLedger(plan, steps_done=6)


def test_a_ledger_file_whose_history_is_not_its_plans_is_refused(tmp_path):
    d = json.loads(OLD_LEDGER)
    d["history"] = [[2.0, 0.2, 3]]  # three steps at the probe's σ, which the plan gives two
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="corrupted.*not the plan's first 3 steps"):
        PrivacyLedger.load(str(tmp_path))


def test_resume_compares_plans():
    checkpoint = PrivacyLedger(_plan(), steps_done=3)
    assert resume_ledger(_plan(), checkpoint, global_step=3) is checkpoint
    other = _plan(phases=[Phase("linear_probe", 2.0, 0.2, 2, 20), Phase("fine_tune", 1.1, 0.1, 3, 10)])
    with pytest.raises(DPConfigError, match="privacy plan changed.*\n  σ of phase 'fine_tune' 1.0 → 1.1 changes the "
                                            "privacy plan: refused"):
        resume_ledger(other, checkpoint, global_step=3)
    with pytest.raises(DPConfigError, match="counts 3 DP steps but its trainer state 2"):
        resume_ledger(_plan(), checkpoint, global_step=2)


def test_the_trainer_plans_then_steps_a_separate_ledger(digits, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=32, max_steps=2,
                               target_epsilon=8.0, target_delta=1e-3, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    trainer = DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=digits["train"].select(range(128)))
    plan = trainer.privacy_plan()
    assert isinstance(plan, PrivacyPlan) and plan == plan_run(args, 128)
    trainer.train()  # plans afresh (the arguments may have changed), then steps a ledger of that plan
    assert trainer.ledger.plan is trainer.privacy_plan() and trainer.ledger.plan == plan
    assert trainer.ledger.steps_done == 2 and not hasattr(trainer.privacy_plan(), "steps_done")


def test_ledger_steps_through_its_phases_and_round_trips(tmp_path):
    ledger = PrivacyLedger(PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0,
                                       clipping="flat", dataset_size=100, poisson_sampling=True,
                                       phases=[Phase("linear_probe", 2.0, 0.2, 2, 20),
                                               Phase("fine_tune", 1.0, 0.1, 3, 10)]))
    for _ in range(5):
        ledger.record_step()
    assert ledger.history == [(2.0, 0.2, 2), (1.0, 0.1, 3)]
    by_phase = ledger.epsilon_by_phase()
    assert by_phase["linear_probe"] == compute_epsilon([(2.0, 0.2, 2)], 1e-5, "rdp")
    assert ledger.epsilon() == compute_epsilon(ledger.history, 1e-5, "rdp") < sum(by_phase.values())
    ledger.save(tmp_path)
    assert PrivacyLedger.load(tmp_path) == ledger


def test_ledger_never_goes_past_planned_steps():
    ledger = PrivacyLedger(PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0,
                                       clipping="flat", dataset_size=100, poisson_sampling=True,
                                       phases=[Phase("train", 1.0, 0.1, 2, 10)]))
    ledger.record_step()
    ledger.record_step()
    with pytest.raises(RuntimeError, match="budget exhausted"):
        ledger.record_step()
    assert ledger.steps_done == 2


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


def test_the_ledger_is_computed_before_its_file_is_opened(tmp_path, monkeypatch):
    from hf_dp_repr.training.plan import plan_run

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, target_delta=1e-3, max_steps=4,
                               per_device_train_batch_size=10, report_to="none")
    ledger = PrivacyLedger(plan_run(args, 100), steps_done=2)
    ledger.save(str(tmp_path))
    before = (tmp_path / "privacy_ledger.json").read_text()

    def interrupted(self):
        raise KeyboardInterrupt  # SIGINT during the (seconds-long) accountant call

    monkeypatch.setattr(PrivacyLedger, "epsilon", interrupted)
    ledger.steps_done = 3
    with pytest.raises(KeyboardInterrupt):
        ledger.save(str(tmp_path))
    assert (tmp_path / "privacy_ledger.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.json"]
