"""DPSFTTrainer in several processes, ONE launch for every check (each launch costs seconds):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trl_sft_worker.py OUT_DIR

Runs (σ = 0, q = 1, one step) DDP over conversations and FSDP2 over users, then a noisy DDP run; rank 0 saves each
run's final weights as OUT_DIR/<run>.pt (tests/test_trl_sft_distributed.py compares them with one process)."""

import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
from hf_dp_repr.tiny import tiny_llama  # noqa: E402
from hf_dp_repr.trl import DPSFTTrainer  # noqa: E402
from hf_dp_repr.trl.chat_data import chat_tokenizer, stdlib_conversations  # noqa: E402
from test_trl_sft import PUBLIC, sft_args  # noqa: E402
from utils import printed_to  # noqa: E402

FSDP = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
# run name → DPSFTConfig fields (per device: the global batch / processes)
RUNS = {
    "ddp": dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, per_sample_max_grad_norm=1.2),
    "fsdp_users": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, per_sample_max_grad_norm=2.0,
                       privacy_unit="user_id", **FSDP),
    "ddp_noisy": dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, noise_multiplier=300.0,
                      per_sample_max_grad_norm=1.0, learning_rate=1e-3, max_steps=2),
}
ROOT = Path(__file__).resolve().parent.parent
RECIPE_ARGS = ["--config", str(ROOT / "recipes" / "configs" / "dp_sft_tiny_llama.yaml"), "--max_steps", "2",
               "--max_conversations", "240", "--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 2}',
               "--disable_tqdm", "true"]


def run(name: str, out: str, world: int, **extra):
    tok = chat_tokenizer(PUBLIC, vocab_size=300)
    chats = stdlib_conversations(max_conversations=12, max_per_user=3, max_chars=120)
    kw = {**RUNS[name], **extra}
    if world == 1:  # the same logical batch in one process, unsharded
        kw["per_device_train_batch_size"] *= 2
        kw = {k: v for k, v in kw.items() if k not in FSDP}
    trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok), seed=1), args=sft_args(Path(out) / name, **kw),
                           train_dataset=chats, processing_class=tok)
    trainer.train()
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in trainer.model.named_parameters()}
    return trainer, weights


if __name__ == "__main__":
    out, world = sys.argv[1], int(os.environ.get("WORLD_SIZE", "1"))
    for name in RUNS:
        trainer, weights = run(name, out, world)
        assert trainer.args.world_size == world and trainer.ledger.plan.world_size == world
        if trainer.is_world_process_zero():
            plan = trainer.ledger.plan
            torch.save({"weights": weights, "epsilon": trainer.epsilon(), "engine": trainer.clipping_engine,
                        "sharded": trainer.sharded, "expected_batch": plan.phases[0].expected_batch_size},
                       os.path.join(out, f"{name}.pt"))
    from hf_dp_repr.scripts import sft

    with printed_to(Path(out) / "logs" / f"recipe.rank{os.environ.get('RANK', '0')}.txt"):
        sft.main([*RECIPE_ARGS, "--output_dir", str(Path(out) / "recipe")])
