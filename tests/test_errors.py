"""The typed errors (hf_dp_repr.errors): the base one exported from the package, raised where they belong, and
still the builtin they replaced, so `except ValueError` / `except RuntimeError` written earlier keeps working."""

import pytest

import hf_dp_repr
from hf_dp_repr import errors
from hf_dp_repr.privacy.ledger import Phase, PrivacyLedger, PrivacyPlan


def test_hierarchy_keeps_the_builtins():
    assert hf_dp_repr.HfDpReprError is errors.HfDpReprError  # the one error the package root names
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.HfDpReprError)
    for cls in (errors.ArgumentError, errors.DPConfigError, errors.NotPrivatizableError, errors.ScopeError,
                errors.OutOfReachError, errors.RecipeArgumentError, errors.DataError, errors.AuditDataError,
                errors.LedgerError):
        assert issubclass(cls, ValueError)
    for cls in (errors.PrivacyBudgetExhaustedError, errors.CheckpointMismatchError, errors.HubAccessError,
                errors.UnsupportedError):
        assert issubclass(cls, RuntimeError)
    assert issubclass(errors.UnsupportedError, NotImplementedError)
    assert issubclass(errors.ArgumentTypeError, TypeError)
    assert issubclass(errors.MissingColumnError, KeyError) and issubclass(errors.MissingColumnError, errors.DataError)
    assert issubclass(errors.OutputDirError, OSError) and issubclass(errors.ModelFileError, OSError)
    assert issubclass(errors.DPConfigError, errors.ArgumentError)  # one argument error family


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


# Builtin exceptions the modules outside privacy/ and the trainer's own modules may still raise, and why: anything
# else a user can meet is a typed error (a subclass of HfDpReprError and of the builtin it replaced).
ANY_MODULE = {"SystemExit": "a command line's exit with its message",
              "AttributeError": "the module __getattr__ protocol",
              "ImportError": "a missing optional dependency, named with its pip command (as Python libraries do)"}
ALLOWED = {("data/embedded.py", "OSError"): "control flow: 'declared offline' is caught three lines below",
           ("training/checkpoints/output_dir.py", "NotADirectoryError"):
               "control flow: caught below, raised as OutputDirError",
           ("privacy/sampler.py", "NotImplementedError"): "the abstract method of the batch samplers' base class"}
NOT_SCANNED = ()  # every module of the package is scanned


def builtin_raises(root):
    import ast
    import builtins

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(NOT_SCANNED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                cls = getattr(builtins, getattr(exc, "id", ""), None)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    yield rel, node.lineno, exc.id


def test_user_facing_refusals_are_typed_errors():
    import pathlib

    package = pathlib.Path(hf_dp_repr.__file__).parent
    plain = [f"{rel}:{line} raise {name}" for rel, line, name in builtin_raises(package)
             if name not in ANY_MODULE and (rel, name) not in ALLOWED]
    assert not plain, "plain builtin raises (use or add a type in hf_dp_repr/errors.py):\n" + "\n".join(plain)
