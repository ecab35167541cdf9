"""A user's own script (not a recipe: it sets no ACCELERATE_USE_CPU) training one DP step on 64 digits; each
process writes what it saw to OUT/rank<RANK>.json. Run by tests/test_processes.py under accelerate launch (not
collected by pytest)."""

import json
import os
import sys

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.tiny import tiny_vit


def main(out: str) -> None:
    args = DPTrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=1, target_epsilon=8.0,
                               target_delta=1e-3, report_to="none", save_strategy="no", disable_tqdm=True,
                               log_level="info")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=load_digits_dataset()["train"].select(range(64)))
    trainer.train()
    trainer.save_model()
    seen = {"world_size": args.world_size, "process_index": args.process_index, "should_save": args.should_save,
            "ledger_world_size": trainer.ledger.plan.world_size}
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1])
