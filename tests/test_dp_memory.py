"""What DP-SGD holds beyond the non-private run (issue 43, item 3): on a LoRA model, per-example work only on the
trained (adapter) modules, never a frozen layer's activations; and the start-of-training probe, which was the run's
memory peak (3 then 4 rows of the whole length, with an autograd graph), no larger than a fraction of a step."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.privacy import ghost_clipping
from hf_dp_repr.tiny import tiny_llama
from utils import make_token_dataset

LENGTH = 48


def lora_llama():
    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.0))


def trainer_for(model, tmp_path, engine="ghost"):
    data = make_token_dataset(n=16, length=LENGTH)
    args = DPTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                               noise_multiplier=1.0, report_to="none", save_strategy="no", disable_tqdm=True,
                               clipping_engine=engine, poisson_sampling=False)
    return DPTrainer(model=model, args=args, train_dataset=data)


def owns_trained(module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_frozen_layers_keep_nothing_for_per_example_work(engine, tmp_path, monkeypatch):
    """Only the LoRA modules are hooked during a step, and (ghost) only their inputs are kept for the norms: seen
    failing with the ghost engine hooking every module that has parameters (the frozen q_proj/v_proj base layers,
    MLPs and norms kept their inputs)."""
    model = lora_llama()
    trainer = trainer_for(model, tmp_path, engine)
    trained = {m for m in model.modules() if owns_trained(m)}
    assert trained and all("lora_" in name for name, m in model.named_modules() if m in trained)
    hooked, kept = [], []

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hooked.append({m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks})

    saved_inputs = ghost_clipping.saved_inputs

    def recording(module, args, kwargs):
        kept.append(module)
        return saved_inputs(module, args, kwargs)

    monkeypatch.setattr(ghost_clipping, "saved_inputs", recording)
    trainer.add_callback(Hooks())
    trainer.train()
    assert hooked and hooked[0] == trained
    if engine == "ghost":
        assert set(kept) == trained and len(kept) == len(trained)  # each adapter once, nothing frozen
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # all removed after the run


def saved_bytes(run) -> int:
    """Bytes of the tensors autograd saves for the backward while `run()` runs (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def test_the_probe_holds_less_than_a_step(tmp_path):
    """The probe's forward with gradients saved 1.5× a step's activations here (3 rows of the whole length against a
    batch of 2); on 2 rows of 16 tokens it saves about a third."""
    model = lora_llama()
    trainer = trainer_for(model, tmp_path)
    probe, step = {}, {}
    probe_rows, training_step = trainer.probe_rows, trainer.training_step

    def measured_probe(*a, **kw):
        probe["bytes"] = saved_bytes(lambda: probe.setdefault("out", probe_rows(*a, **kw)))
        return probe["out"]

    def measured_step(*a, **kw):
        step["bytes"] = saved_bytes(lambda: step.setdefault("out", training_step(*a, **kw)))
        return step["out"]

    trainer.probe_rows, trainer.training_step = measured_probe, measured_step
    trainer.train()
    assert 0 < probe["bytes"] < step["bytes"] / 2, (probe["bytes"], step["bytes"])
