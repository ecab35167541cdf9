"""Bad input fails before anything is trained or written, naming the argument and the fix."""

import pytest
import torch
from datasets import Dataset, IterableDataset

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.errors import NotPrivatizableError
from hf_dp_repr.tiny import tiny_vit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_epsilon": 0.0}, "target_epsilon must be > 0"),
        ({"target_epsilon": -1.0}, "target_epsilon must be > 0"),
        ({"target_epsilon": 1.0, "target_delta": 0.0}, "target_delta must be in"),
        ({"target_epsilon": 1.0, "target_delta": 1.0}, "target_delta must be in"),
        ({"target_epsilon": 1.0, "noise_multiplier": 1.0}, "both target_epsilon and noise_multiplier"),
        ({}, "neither target_epsilon nor noise_multiplier.*noise_multiplier=0"),
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


def _args(out):
    return DPTrainingArguments(output_dir=str(out), target_epsilon=1.0, target_delta=1e-5, report_to="none")


def test_iterable_dataset_is_refused(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter([{"pixel_values": torch.zeros(1, 8, 8), "labels": 0}]))
    with pytest.raises(ValueError, match="must have a length"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), train_dataset=stream)
    assert not (tmp_path / "never").exists()


def test_dataset_without_length_is_refused(tmp_path):
    class NoLength(torch.utils.data.Dataset):
        def __getitem__(self, i):
            return {"labels": 0}

    with pytest.raises(ValueError, match="must have a length"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), train_dataset=NoLength())


def test_delta_above_one_over_n_warns_with_n(tmp_path):
    small = Dataset.from_dict({"pixel_values": torch.zeros(50, 1, 8, 8).numpy(), "labels": [0] * 50})
    args = DPTrainingArguments(output_dir=str(tmp_path / "o"), target_epsilon=1.0, target_delta=0.05, report_to="none")
    with pytest.warns(UserWarning, match="n=50"):
        DPTrainer(model=tiny_vit(), args=args, train_dataset=small)


def test_batchnorm_is_refused_with_its_path(tmp_path):
    model = tiny_vit()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    with pytest.raises(NotPrivatizableError, match=r"classifier\.0 \(BatchNorm1d\).*ModuleValidator\.fix"):
        DPTrainer(model=model, args=_args(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_vit_embedding_dropout_is_refused(tmp_path):
    with pytest.raises(NotPrivatizableError, match="hidden_dropout_prob=0"):
        DPTrainer(model=tiny_vit(hidden_dropout_prob=0.1), args=_args(tmp_path / "never"))


def test_compute_loss_func_is_refused(tmp_path):
    with pytest.raises(ValueError, match="per_example_loss"):
        DPTrainer(model=tiny_vit(), args=_args(tmp_path / "never"), compute_loss_func=lambda *a, **k: 0)
