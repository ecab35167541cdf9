"""The LP→FT budget curve on the embedded default: accuracy against the share of ε spent linear probing.

A 4-block ViT pre-trained non-privately on a public 30 % of sklearn's digits, then DP LP→FT runs (one per point)
on the private 70 %, scored on the test split. Logic in `hf_dp_repr.tuning.budget_split`.

    python recipes/lp_budget_split.py --output_dir split_out --target_epsilon 1 --fractions 0.1 0.3 0.5 0.7 0.9
"""

from hf_dp_repr.entry_point import CommandParser, prepare_entry_point

prepare_entry_point(tiny_model=True)  # before torch loads; one thread: tiny ViTs (hf_dp_repr/entry_point.py)


def main(argv=None):
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="split_out")
    p.add_argument("--target_epsilon", type=float, default=1.0)
    p.add_argument("--target_delta", type=float, default=1e-3)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--lp_steps", type=float, nargs="+", default=[0.2, 0.5])
    p.add_argument("--trainable_blocks", type=int, default=2)
    p.add_argument("--num_train_epochs", type=float, default=10)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--pretrain_epochs", type=int, default=30)
    a = p.parse_args(argv)  # before the imports: a mistyped flag is refused at once
    from transformers import ViTForImageClassification

    from hf_dp_repr import DPTrainingArguments
    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.scripts.seed000 import pretrain_public, split_off
    from hf_dp_repr.tiny import tiny_vit
    from hf_dp_repr.tuning.budget_split import sweep_budget_split, write_budget_split

    digits = load_digits_dataset()
    private, public = split_off(digits["train"], 0.3)
    base = pretrain_public(tiny_vit(), public, f"{a.output_dir}/public_pretrained", epochs=a.pretrain_epochs)
    args = DPTrainingArguments(output_dir=a.output_dir, target_epsilon=a.target_epsilon, target_delta=a.target_delta,
                               trainable_blocks=a.trainable_blocks, num_train_epochs=a.num_train_epochs,
                               learning_rate=a.learning_rate, per_device_train_batch_size=128, report_to="none",
                               save_strategy="no", logging_strategy="no", disable_tqdm=True)
    result = sweep_budget_split(lambda: ViTForImageClassification.from_pretrained(base), args, private,
                                digits["test"], fractions=a.fractions, lp_steps=a.lp_steps)
    print("\n".join(write_budget_split(result, a.output_dir)))
    print(result.summary())
    return result


if __name__ == "__main__":
    from hf_dp_repr.scripts.runner import run_command

    raise SystemExit(run_command(main))  # one runner: an argument error is one line, exit code 2
