"""The typed errors (hf_dp_repr.errors): exported from the package, raised where they belong, and still the builtin
they replaced, so `except ValueError` / `except RuntimeError` written earlier keeps working."""

import pytest

import hf_dp_repr
from hf_dp_repr import errors
from hf_dp_repr.privacy.ledger import Phase, PrivacyLedger, PrivacyPlan


def test_hierarchy_is_exported_and_keeps_the_builtins():
    for name in errors.__all__:
        assert getattr(hf_dp_repr, name) is getattr(errors, name), name
        assert issubclass(getattr(errors, name), errors.HfDpReprError)
    for cls in (errors.DPConfigError, errors.NotPrivatizableError, errors.ScopeError, errors.OutOfReachError):
        assert issubclass(cls, ValueError)
    for cls in (errors.PrivacyBudgetExhaustedError, errors.CheckpointMismatchError, errors.HubAccessError):
        assert issubclass(cls, RuntimeError)
    assert issubclass(errors.OutputDirError, OSError)


def test_old_import_paths_still_work():
    from hf_dp_repr.hub import HubAccessError
    from hf_dp_repr.privacy.accounting import OutOfReachError
    from hf_dp_repr.privacy.validation import NotPrivatizableError
    from hf_dp_repr.scope import ScopeError
    from hf_dp_repr.scripts.checks import RecipeArgumentError
    from hf_dp_repr.training.checkpoint import CheckpointMismatchError

    assert (CheckpointMismatchError, HubAccessError, OutOfReachError, NotPrivatizableError, ScopeError) == (
        errors.CheckpointMismatchError, errors.HubAccessError, errors.OutOfReachError, errors.NotPrivatizableError,
        errors.ScopeError)
    assert issubclass(RecipeArgumentError, errors.DPConfigError)


def test_bad_arguments_raise_dp_config_error():
    with pytest.raises(errors.DPConfigError, match="target_epsilon"):
        hf_dp_repr.DPTrainingArguments(output_dir="o", report_to="none", target_epsilon=-1.0)


def test_exhausted_budget_is_a_typed_error_not_a_bare_runtime_error():
    ledger = PrivacyLedger(PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0,
                                       clipping="flat", dataset_size=100, poisson_sampling=True,
                                       phases=[Phase("train", noise_multiplier=1.0, sample_rate=0.1, steps=2,
                                                     expected_batch_size=10)]))
    ledger.record_step()
    ledger.record_step()
    with pytest.raises(errors.PrivacyBudgetExhaustedError, match="Privacy budget exhausted: 2 of 2"):
        ledger.record_step()
    assert ledger.steps_done == 2
