"""Helpers shared by the test files (`from utils import ...`; pytest puts tests/ on the import path): datasets of
random tokens, one DP step of DPTrainer against a brute-force loop, a stand-in for the Hub, a callback that stops."""

from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from huggingface_hub import CommitInfo, HfApi, RepoUrl, hf_api
from huggingface_hub import constants as hf_constants
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments


# ---- datasets -----------------------------------------------------------------------------------------------
def make_token_dataset(n: int = 24, length: int = 8, vocab: int = 128, seed: int = 0) -> Dataset:
    """Random token sequences with right padding of random length (labels -100 on padding)."""
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        valid = int(rng.integers(3, length + 1))
        ids = rng.integers(1, vocab, size=length)
        mask = (np.arange(length) < valid).astype(np.int64)
        ids = np.where(mask == 1, ids, 0)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append(mask)
        rows["labels"].append(np.where(mask == 1, ids, -100))
    return Dataset.from_dict(rows).with_format("torch")



def make_token_classification_dataset(n: int = 24, length: int = 8, vocab: int = 128, num_labels: int = 2,
                                      seed: int = 0) -> Dataset:
    """Random token sequences (right-padded) with a random class label each."""
    rows = make_token_dataset(n, length, vocab, seed).with_format(None).to_dict()
    rows["labels"] = np.random.default_rng(seed + 1).integers(0, num_labels, size=n).tolist()
    return Dataset.from_dict(rows).with_format("torch")


# ---- one DP step against a brute-force loop ------------------------------------------------------------
BATCH, ACCUMULATION = 4, 3  # logical batch L = 12 of n = 24 examples: q = 0.5


class CaptureUpdate(TrainerCallback):
    """Keeps the private gradient the optimizer applied at the first step (p.grad right after the DP step)."""

    def __init__(self):
        self.grads = None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_one_step(model, dataset, tmp_path, **dp_kwargs):
    capture = CaptureUpdate()
    args = DPTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=3, noise_seed=3, **dp_kwargs,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, callbacks=[capture])
    trainer.train()
    sampler = trainer._batch_sampler
    sampler.set_epoch(0)
    batch = [i for chunk in list(sampler)[:ACCUMULATION] for i in chunk]
    return capture.grads, batch


def brute_force_update(model, dataset, batch, clip, clipping):
    """Σ_i clip(∇ loss_i) / L with each example's gradient computed alone through the model's own HF loss."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in batch:
        example = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
        grads = torch.autograd.grad(model(**example).loss, params)
        if clipping == "flat":
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
            grads = [g * min(1.0, clip / norm.item()) for g in grads]
        else:  # per_layer: each tensor to C / sqrt(#tensors)
            c = clip / len(grads) ** 0.5
            grads = [g * min(1.0, c / g.norm().item()) for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return {n: t / (BATCH * ACCUMULATION) for n, t in zip(names, total)}


def relative_error(got: dict, want: dict) -> float:
    num = sum(((got[n] - want[n]).double() ** 2).sum() for n in want)
    den = sum((want[n].double() ** 2).sum() for n in want)
    return (num / den).sqrt().item()


# ---- the Hub, captured ----------------------------------------------------------------------------------------
class HubCapture:
    """Stands in for the Hub: records whoami, create_repo and the operations of each create_commit (`commits`: the
    sorted paths of each push), so the real upload_folder filtering runs and nothing reaches the network."""

    def __init__(self, monkeypatch, user="someone", role="write"):
        self.repos, self.files, self.validated, self.commits, self.whoami_calls = [], {}, [], [], 0

        def whoami(api, token=None, **kw):
            self.whoami_calls += 1
            return {"type": "user", "name": user, "orgs": [], "auth": {"accessToken": {"role": role}}}

        def create_repo(api, repo_id, **kw):
            self.repos.append((repo_id, kw.get("private")))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def create_commit(api, repo_id, operations, **kw):
            self.commits.append(sorted(op.path_in_repo for op in operations))
            for op in operations:
                src = op.path_or_fileobj
                self.files[op.path_in_repo] = src.read_bytes() if hasattr(src, "read_bytes") else open(src, "rb").read()
            return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/0", commit_message="m",
                              commit_description="", oid="0" * 40)

        def validate_yaml(api, content, **kw):  # the Hub's metadata check of README.md, also a request
            self.validated.append(content)

        # With hf_xet installed, upload_folder streams through its own pipeline; the single-commit path hands every
        # file to create_commit, which is where we listen.
        monkeypatch.setattr(hf_api, "is_xet_available", lambda: False, raising=False)
        monkeypatch.setattr(HfApi, "_validate_yaml", validate_yaml)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # the calls below never reach the network
        monkeypatch.setattr(HfApi, "whoami", whoami)
        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)


# ---- training control -------------------------------------------------------------------------------------------
class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


ACCEL_CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_configs" / "cpu_2proc.yaml"


def free_port() -> int:
    """A free TCP port for `accelerate launch --main_process_port` (tests running side by side must not collide)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
