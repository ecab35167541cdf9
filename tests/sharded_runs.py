"""DPTrainer runs shared by the sharded worker (2 processes, tests/sharded_worker.py) and tests/test_sharding.py (the
same runs in one process, sharded over a 1-rank group or not sharded), so that their results can be compared."""

import os

import torch
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments

FSDP = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
GLOBAL_BATCH = 4  # per device × processes (the logical batch is this × accumulation)


def full_weights(model) -> dict[str, torch.Tensor]:
    """{name: the whole tensor} (gathered when sharded: a collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _args(out, world, sharded, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=2,
                learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, report_to="none",
                disable_tqdm=True, seed=0, noise_seed=11, target_delta=1e-4, per_sample_max_grad_norm=0.5,
                save_strategy="no")
    return DPTrainingArguments(**{**(FSDP if sharded else {}), **base, **kw})


class EmptyCounter(DPTrainer):
    """A DPTrainer that counts the micro-batches that were empty on this rank."""

    empty_micro_batches = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not inputs:
            type(self).empty_micro_batches += 1
        return super().training_step(model, inputs, num_items_in_batch)


def vit_lp_then_ft(out, world: int, sharded: bool):
    """σ = 0, a linear-probing step then a full fine-tuning step of a tiny ViT on 64 digits (Poisson micro-batches of
    1 row per process expected: with noise_seed 13, 4 of the 2 processes' 8 are empty). Returns (the trainer, its
    final weights)."""
    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.tiny import tiny_vit

    train = load_digits_dataset()["train"].select(range(64))
    args = _args(out, world, sharded, noise_multiplier=0.0, max_steps=2, lp_steps=1, noise_seed=13,  # (4 empty)
                 per_device_train_batch_size=2 // world, gradient_accumulation_steps=2)
    trainer = EmptyCounter(model=tiny_vit(seed=0), args=args, train_dataset=train)
    trainer.train()
    return trainer, full_weights(trainer.model)


def gpt2_run(out, world: int, sharded: bool = True, resume: str | None = None, callbacks=(), **kw):
    """A tiny GPT-2 (tied wte/lm_head), AdamW (or `optim=`), σ = 0.7 with noise_seed, 2 steps of 2 micro-batches, a
    checkpoint at each step. Returns (the trainer, its final weights)."""
    from hf_dp_repr.tiny import tiny_gpt2
    from utils import make_token_dataset

    args = _args(out, world, sharded, **{"noise_multiplier": 0.7, "max_steps": 2, "optim": "adamw_torch",
                                         "save_strategy": "steps", "save_steps": 1, **kw})
    trainer = DPTrainer(model=tiny_gpt2(seed=0), args=args, train_dataset=make_token_dataset(n=48),
                        callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    weights = full_weights(trainer.model)
    trainer.save_model(os.path.join(str(out), "final"))
    return trainer, weights


# ---- the accuracy arguments (issue 31) sharded: ema_decay, augmentation_multiplicity, probe_preconditioning ------
class Iterates(TrainerCallback):
    """The whole trained weights at the start and after every noisy step: the raw DP iterates (a collective when
    sharded: every rank records)."""

    def __init__(self):
        self.seen = []

    def _record(self, model):
        self.seen.append({n: w for n, w in full_weights(model).items()
                          if dict(model.named_parameters())[n].requires_grad})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._record(model)


def _noisy_pixels(batch):
    """A random augmentation (`with_transform`): Gaussian pixel noise from torch's global generator."""
    return {"pixel_values": [torch.tensor(x, dtype=torch.float32) + torch.randn(1, 8, 8) for x in
                             batch["pixel_values"]], "labels": batch["labels"]}


def views_run(out, world: int, sharded: bool = True):
    """σ = 0, a step of a tiny ViT on 32 digits read through a random transform, 3 views per example (their mean
    gradient clipped once: C = 0.5 clips most). Returns its final weights."""
    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.tiny import tiny_vit

    train = load_digits_dataset()["train"].select(range(32)).with_format(None).with_transform(_noisy_pixels)
    args = _args(out, world, sharded, noise_multiplier=0.0, max_steps=1, augmentation_multiplicity=3, learning_rate=1.0,
                 clipping_engine="ghost")  # (the engine of sharded runs; unsharded, "auto" picks the slower hooks)
    trainer = DPTrainer(model=tiny_vit(seed=0), args=args, train_dataset=train)
    trainer.train()
    return full_weights(trainer.model)


def probe_run(out, world: int, sharded: bool = True):
    """σ = 0, 2 steps of a linear probe (a tiny ViT's head) on 32 digits, its input preconditioned with 'pca:4'
    fitted on 100 other, unlabelled digits, its iterates averaged (ema_decay=0.5), evaluated after each step; saved
    to `out`. Sharded with reshard_after_forward=False: a forward without backward (the public set's, evaluations)
    leaves the gathered weights on the modules. Returns the trainer."""
    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.tiny import tiny_vit

    rows = load_digits_dataset()["train"]
    kept_gathered = {"fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False}} if sharded else {}
    args = _args(out, world, sharded, noise_multiplier=0.0, max_steps=2, trainable_blocks=0, learning_rate=0.5,
                 probe_preconditioning="pca:4", ema_decay=0.5, eval_strategy="steps", eval_steps=1, **kept_gathered)
    trainer = DPTrainer(model=tiny_vit(seed=0), args=args, train_dataset=rows.select(range(32)),
                        eval_dataset=rows.select(range(32, 40)),
                        public_train_dataset=rows.select(range(1000, 1100)).remove_columns("labels"))
    trainer.train()
    trainer.save_model()
    return trainer
