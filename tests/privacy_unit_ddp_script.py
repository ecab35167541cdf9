"""One σ = 0 DP step with privacy_unit='user_id' (q = 1), in 1 or 2 processes; rank 0 saves the update.
Run by tests/test_ddp.py::test_two_processes_clip_each_unit_once (not collected by pytest)."""

import sys

import torch
from datasets import Dataset

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.tiny import tiny_vit

USERS = ["big"] * 11 + ["solo"] + ["u1", "u1", "u2", "u2", "u3", "u3", "u4", "u4"]


def main(out: str, per_device: int, accumulation: int) -> None:
    rows = load_digits_dataset()["train"].select(range(len(USERS))).with_format(None).to_dict()
    rows["user_id"] = USERS
    data = Dataset.from_dict(rows).with_format("torch", columns=["pixel_values", "labels"], output_all_columns=True)
    model = tiny_vit(num_labels=10, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPTrainingArguments(
        output_dir=out + "_run", per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=1, noise_multiplier=0.0, per_sample_max_grad_norm=0.05, privacy_unit="user_id", learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=3, noise_seed=3, target_delta=1e-3)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        led = trainer.ledger
        update = {n: (before[n] - p.detach()) * led.expected_batch_size for n, p in trainer.model.named_parameters()}
        torch.save({"update": update, "dataset_size": led.plan.dataset_size, "world_size": led.plan.world_size,
                    "sample_rate": led.plan.phases[0].sample_rate}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
