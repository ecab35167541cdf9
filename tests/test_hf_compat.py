"""The private transformers / Opacus members we override or rely on (hf_dp_repr/training/hf_compat.py) are still
what we rely on in the installed versions. A failure names the installed version and the tested range."""

import importlib
import inspect
import pathlib
import re

import pytest
import torch
import transformers
from transformers import Trainer

from hf_dp_repr.audit.dirac import DiracCanaryTrainer
from hf_dp_repr.training import hf_compat
from hf_dp_repr.training.trainer import DPTrainer

VERSION = f"transformers {transformers.__version__} (tested: {hf_compat.TESTED_TRANSFORMERS})"
OWNERS = {"DPTrainer": DPTrainer, "DiracCanaryTrainer": DiracCanaryTrainer}


def _source(name: str) -> str:
    return inspect.getsource(getattr(Trainer, name))


def _params(function) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


@pytest.mark.parametrize("member", hf_compat.PRIVATE_OVERRIDES + hf_compat.PRIVATE_USED, ids=lambda m: m.name)
def test_each_private_member_keeps_its_signature_and_its_caller(member):
    assert hasattr(Trainer, member.name), f"{VERSION}: Trainer.{member.name} is gone ({member.why})."
    got = _params(getattr(Trainer, member.name))
    assert got == member.params, f"{VERSION}: Trainer.{member.name} now takes {got}, not {member.params}."
    assert member.call in _source(member.caller), (
        f"{VERSION}: Trainer.{member.name} is no longer called by Trainer.{member.caller} as `{member.call}`; "
        f"we rely on it to {member.why}.")


@pytest.mark.parametrize("member", hf_compat.PRIVATE_OVERRIDES, ids=lambda m: f"{m.owner}.{m.name}")
def test_each_override_matches_the_trainers_signature(member):
    ours = getattr(OWNERS[member.owner], member.name)
    assert ours is not getattr(Trainer, member.name), f"{member.owner} no longer overrides {member.name}: unlist it."
    assert _params(ours) == member.params, f"{VERSION}: {member.owner}.{member.name} takes {_params(ours)}."


@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_no_private_override_outside_the_list(owner):
    listed = {m.name for m in hf_compat.PRIVATE_OVERRIDES if m.owner in (owner, "DPTrainer")}
    cls = OWNERS[owner]
    overridden = {name for name in dir(Trainer) if name.startswith("_") and not name.startswith("__")
                  and callable(getattr(Trainer, name)) and getattr(cls, name) is not getattr(Trainer, name)}
    assert overridden <= listed, f"{owner} overrides private Trainer members not in hf_compat: {overridden - listed}"


@pytest.mark.parametrize("name,why", hf_compat.ATTRIBUTES)
def test_each_attribute_is_still_the_trainers(name, why):
    assert re.search(rf"self\.{name}\s*=", inspect.getsource(Trainer)), (
        f"{VERSION}: Trainer no longer sets `self.{name}` ({why}).")


@pytest.mark.parametrize("method,texts", hf_compat.ORDER, ids=[m for m, _ in hf_compat.ORDER])
def test_the_loop_calls_in_the_order_we_rely_on(method, texts):
    source, at = _source(method), 0
    for text in texts:
        found = source.find(text, at)
        assert found >= 0, f"{VERSION}: Trainer.{method} no longer calls `{text}` after `{texts[0]}`...: {texts}."
        at = found + len(text)


def test_no_item_count_once_the_model_accepts_no_loss_kwargs(digits, tmp_path):
    """What replaced DPTrainer._get_num_items_in_batch: model_accepts_loss_kwargs=False, and the Trainer's count
    then gives None (it would scale the loss, and crash on an empty Poisson micro-batch)."""
    from hf_dp_repr import DPTrainingArguments
    from hf_dp_repr.tiny import tiny_vit

    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, report_to="none", save_strategy="no")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(64)))
    assert trainer.model_accepts_loss_kwargs is False
    batch = {"labels": torch.tensor([1, 2, -100]), "pixel_values": torch.zeros(3, 1, 8, 8)}
    assert trainer._get_num_items_in_batch([batch], torch.device("cpu")) is None, VERSION
    trainer.model_accepts_loss_kwargs = True  # what the Trainer set from the model: the count happens
    assert trainer._get_num_items_in_batch([batch], torch.device("cpu")) is not None, VERSION


@pytest.mark.parametrize("module,name,params", hf_compat.OPACUS_PRIVATE)
def test_opacus_private_helpers(module, name, params):
    import opacus

    function = getattr(importlib.import_module(module), name, None)
    tested = f"opacus {opacus.__version__} (tested: {hf_compat.TESTED_OPACUS})"
    assert function is not None, f"{tested}: {module}.{name} is gone."
    assert _params(function) == params, f"{tested}: {module}.{name} takes {_params(function)}, not {params}."


@pytest.mark.parametrize("name,why", hf_compat.DATASETS_PRIVATE)
def test_datasets_private_attributes_still_follow_the_rows(name, why):
    from datasets import Dataset

    rows = Dataset.from_dict({"a": [1, 2]})
    assert isinstance(getattr(rows, name, None), str), f"datasets: Dataset.{name} is gone ({why})."
    assert getattr(rows.map(lambda r: {"a": r["a"] + 1}), name) != getattr(rows, name), (
        f"datasets: Dataset.{name} no longer changes with the rows ({why}).")


def test_the_pins_are_the_tested_ranges():
    setup = (pathlib.Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    for pin in (hf_compat.TESTED_TRANSFORMERS, hf_compat.TESTED_OPACUS):
        assert pin.replace(" ", "") in setup.replace(" ", ""), f"setup.cfg does not pin {pin}"
