"""Weight averaging, `ema_decay` (training/averaging.py; issue 31 item 1): the released weights are the exponential
moving average of the DP iterates (saved, evaluated, in checkpoints' model files, on the card), the raw iterate keeps
training, both resume exactly, and what cannot work is refused before any work."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import CheckpointMismatchError, DPConfigError
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.averaging import AVERAGE_FILE, decay_at

DECAY, STEPS = 0.8, 4


class Iterates(TrainerCallback):
    """The trained parameters after every noisy step (the raw DP iterates)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append({n: p.detach().clone().double() for n, p in model.named_parameters() if p.requires_grad})


def _args(out, **overrides):
    kwargs = dict(output_dir=str(out), noise_multiplier=1.0, target_delta=1e-3, accountant="rdp", max_steps=STEPS,
                  per_device_train_batch_size=16, learning_rate=0.05, report_to="none", disable_tqdm=True, seed=0,
                  noise_seed=5, save_strategy="no", ema_decay=DECAY)
    kwargs.update(overrides)
    return DPTrainingArguments(**kwargs)


@pytest.fixture(scope="module")
def data(digits):
    return digits["train"].select(range(96))


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """One averaged run of a linear probe (its initial weights and iterates recorded), saved and evaluated."""
    out = tmp_path_factory.mktemp("ema")
    model = tiny_vit()
    start = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    iterates = Iterates()
    trainer = DPTrainer(model=model, args=_args(out, trainable_blocks=1), train_dataset=data, callbacks=[iterates])
    trainer.train()
    trainer.save_model()
    return trainer, start, iterates.seen, out


def _by_hand(start, iterates):
    average = {n: start[n].clone() for n in iterates[0]}
    for t, theta in enumerate(iterates):
        d = decay_at(DECAY, t)
        average = {n: d * average[n] + (1 - d) * theta[n] for n in average}
    return average


def test_saved_weights_are_the_average_of_the_iterates_computed_by_hand(run):
    trainer, start, iterates, out = run
    assert len(iterates) == STEPS and decay_at(DECAY, 0) == pytest.approx(0.1)
    expected = _by_hand(start, iterates)
    saved = load_file(str(out / "model.safetensors"))
    model_names = dict(trainer.model.named_parameters())
    for name, value in expected.items():
        assert not torch.allclose(value, iterates[-1][name]), name  # the average is not the last iterate
        live = model_names[name].detach().double()
        torch.testing.assert_close(live, value, rtol=0, atol=1e-6)  # after train(): the model holds the average
    for name, tensor in saved.items():  # frozen tensors saved as they were; trained ones averaged
        if name in expected:
            torch.testing.assert_close(tensor.double(), expected[name], rtol=0, atol=1e-6)
        elif name in start:
            assert torch.equal(tensor.double(), start[name]), name
    raw = trainer.weight_average.raw
    for name in expected:  # the last raw iterate is kept
        assert torch.equal(raw[name].double(), iterates[-1][name])
    assert "exponential moving average" in (out / "README.md").read_text()  # the card says what is released


def test_evaluation_during_training_sees_the_average(data, tmp_path):
    seen = []

    class AtEval(TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kwargs):
            seen.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path, trainable_blocks=0, eval_strategy="steps",
                                                     eval_steps=2, max_steps=2),
                        train_dataset=data, eval_dataset=data.select(range(8)), callbacks=[AtEval()])
    trainer.train()
    assert len(seen) == 1
    for name, value in seen[0].items():
        assert torch.equal(value, trainer.weight_average.average[name])
        assert not torch.equal(value, trainer.weight_average.raw[name])


def test_resume_continues_both_the_iterate_and_the_average_exactly(data, tmp_path):
    straight = DPTrainer(model=tiny_vit(), args=_args(tmp_path / "a"), train_dataset=data)
    straight.train()
    out = tmp_path / "b"
    first = DPTrainer(model=tiny_vit(), args=_args(out, save_strategy="steps", save_steps=2), train_dataset=data)
    first.train()
    saved = torch.load(out / "checkpoint-2" / AVERAGE_FILE, weights_only=True)
    assert saved["updates"] == 2 and saved["decay"] == DECAY
    resumed = DPTrainer(model=tiny_vit(), args=_args(out, save_strategy="steps", save_steps=2), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.weight_average.updates == STEPS
    for name, p in straight.model.named_parameters():
        assert torch.equal(p, dict(resumed.model.named_parameters())[name]), name  # the averages
    for name, value in straight.weight_average.raw.items():
        assert torch.equal(value, resumed.weight_average.raw[name]), name  # the raw iterates


def test_resume_with_another_ema_decay_is_refused(data, tmp_path):
    DPTrainer(model=tiny_vit(), args=_args(tmp_path, save_strategy="steps", save_steps=2, max_steps=2),
              train_dataset=data).train()
    for decay in (None, 0.5):  # (a finished run: its weights are restored, and they are not what this run means)
        trainer = DPTrainer(model=tiny_vit(), args=_args(tmp_path, ema_decay=decay, max_steps=2), train_dataset=data)
        with pytest.raises(CheckpointMismatchError, match="ema_decay"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize("decay", [1.0, -0.1])
def test_an_ema_decay_out_of_range_is_refused(decay):
    with pytest.raises(DPConfigError, match="ema_decay"):
        DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, ema_decay=decay, report_to="none")


COMBINATIONS = {
    "all parameters, hooks": dict(clipping_engine="hooks"),
    "last block, ghost": dict(trainable_blocks=1, clipping_engine="ghost"),
    "groups": dict(trainable_groups="biases,head"),
    "LP→FT": dict(trainable_blocks=1, lp_steps=2),
    "privacy unit": dict(trainable_blocks=0, privacy_unit="user_id", per_device_train_batch_size=3),
    "LoRA": dict(),
}


@pytest.mark.parametrize("name", COMBINATIONS)
def test_every_scope_engine_and_unit_releases_the_average(name, digits, data, tmp_path):
    from peft import LoraConfig

    from utils import user_dataset

    train = user_dataset(digits) if name == "privacy unit" else data
    peft_config = (LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])
                   if name == "LoRA" else None)
    model = tiny_vit()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=_args(tmp_path, **{"per_device_train_batch_size": 8, **COMBINATIONS[name]}),
                        train_dataset=train, peft_config=peft_config)
    trainer.train()
    average = trainer.weight_average
    assert average.updates == STEPS and average.params
    live = dict(trainer.model.named_parameters())
    for n, value in average.average.items():
        assert torch.equal(live[n], value)  # the model holds the average
    assert any(not torch.equal(average.raw[n], value) for n, value in average.average.items())
    if name != "LoRA":  # nothing outside the optimizer's parameters moved
        assert all(torch.equal(p, start[n]) for n, p in live.items() if n not in average.params)


def test_the_accuracy_arguments_come_from_a_recipe_yaml(tmp_path):
    from hf_dp_repr.scripts.arguments import ScriptArguments, parse_args

    config = tmp_path / "accuracy.yaml"
    config.write_text("ema_decay: 0.99\naugmentation_multiplicity: 4\nprobe_preconditioning: pca:16\n")
    _, args = parse_args((ScriptArguments, DPTrainingArguments), [
        "--config", str(config), "--dataset_name", "digits", "--output_dir", str(tmp_path), "--target_epsilon", "1",
        "--report_to", "none"])
    assert (args.ema_decay, args.augmentation_multiplicity, args.probe_preconditioning) == (0.99, 4, "pca:16")
