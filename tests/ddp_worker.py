"""The runs tests/test_ddp.py compares, in ONE process or ONE launch of 2 (each launch costs ~10-20 s of imports):

    python tests/ddp_worker.py OUT                                              # 1 process
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml tests/ddp_worker.py OUT   # 2 (gloo)

One after the other, in the same processes, each writing under OUT/<name> (not collected by pytest):
- `user` (2 processes only, first: the launch environment as the launcher made it): a user's own script
  (tests/one_run_user_script.py), which sets no ACCELERATE_USE_CPU;
- `noise`, `exact`, `lpft`: the image recipe, one SGD step at σ = 1000; one at σ = 0; LP→FT (2 steps, the first on
  the head only) at σ = 0; the global batch is GLOBAL_BATCH whatever the number of processes;
- `adaptive`: the image recipe, 3 steps of adaptive clipping (σ = 1, σ_b = 2, C from 0.01);
- `eval`: the text recipe (real MiniLM) with lr = 0, evaluated;
- `unit.pt`: one σ = 0 step with privacy_unit='user_id' (tests/privacy_unit_ddp_script.py);
- `logs` (2 processes only): the image recipe at ε = 8 with public pre-training;
- `lm` (2 processes only): the LM recipe sharded (`--fsdp full_shard`, FSDP2) over documents, as the README launches it.
Each process writes what each run printed (its stdout and stderr) to OUT/logs/<name>.rank<R>.txt."""

import os
import sys
from pathlib import Path

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # what the recipes' files do first

import one_run_user_script  # noqa: E402  (tests/, this file's folder, is on the path)
import privacy_unit_ddp_script  # noqa: E402
from hf_dp_repr.scripts import causal_lm, image_classification, text_classification  # noqa: E402
from utils import printed_to  # noqa: E402

SIGMA, LR, GLOBAL_BATCH = 1000.0, 1e-3, 32
COMMON = ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]


def image_args(out: Path, world: int, sigma: float, steps: int = 1) -> list[str]:
    return ["--output_dir", str(out), "--public_fraction", "0", "--noise_multiplier", str(sigma),
            "--per_device_train_batch_size", str(GLOBAL_BATCH // world), "--max_steps", str(steps), "--optim", "sgd",
            "--learning_rate", str(LR), "--lr_scheduler_type", "constant", "--weight_decay", "0",
            "--target_delta", "1e-4", "--max_eval_samples", "64", "--seed", "0", "--noise_seed", "0",
            "--dp_defaults", "off", *COMMON]  # every parameter trains: the update's noise is measured over all of them


def main(out: Path) -> None:
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    runs = {"user": lambda: one_run_user_script.main(str(out / "user"))} if world > 1 else {}
    runs |= {
        "noise": lambda: image_classification.main(image_args(out / "noise", world, SIGMA)),
        "exact": lambda: image_classification.main(image_args(out / "exact", world, 0.0)),
        "lpft": lambda: image_classification.main([*image_args(out / "lpft", world, 0.0, steps=2), "--lp_steps", "1"]),
        "adaptive": lambda: image_classification.main([
            *image_args(out / "adaptive", world, 1.0, steps=3), "--adaptive_clipping", "count_noise=2",
            "--per_sample_max_grad_norm", "0.01"]),
        "eval": lambda: text_classification.main([
            "--output_dir", str(out / "eval"), "--noise_multiplier", "0", "--learning_rate", "0", "--max_steps", "1",
            "--trainable_blocks", "0", "--max_train_samples", "64", "--max_eval_samples", "32", "--max_length", "32",
            "--per_device_eval_batch_size", "8", *COMMON]),
        "unit": lambda: privacy_unit_ddp_script.main(str(out / "unit.pt"), 6 // world, 1),
    }
    if world > 1:  # what the logs of a 2-process recipe run show
        runs["logs"] = lambda: image_classification.main([
            "--output_dir", str(out / "logs_run"), "--target_epsilon", "8", "--target_delta", "1e-4",
            "--public_fraction", "0.3", "--public_epochs", "2", "--per_device_train_batch_size", "16",
            "--max_steps", "2", "--max_eval_samples", "64", *COMMON])
        runs["lm"] = lambda: causal_lm.main([
            "--output_dir", str(out / "lm"), "--model_name_or_path", "tiny_gpt2", "--target_epsilon", "8",
            "--target_delta", "1e-5", "--max_steps", "2", "--per_device_train_batch_size", "8", "--block_size", "64",
            "--public_epochs", "1", "--max_eval_blocks", "16", "--fsdp", "full_shard", "--fsdp_config",
            '{"fsdp_version": 2}', *COMMON])
    for name, run in runs.items():
        with printed_to(out / "logs" / f"{name}.rank{rank}.txt"):
            run()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
