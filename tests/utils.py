"""Helpers shared by the test files (`from utils import ...`; pytest puts tests/ on the import path): datasets of
random tokens, one DP step of DPTrainer against a brute-force loop, a callback that stops, a free port, DP arguments
with the common test defaults, the exact ε of full-batch steps, and datasets of users with their brute-force clipped
sum. The Hub is a local server: hf_dp_repr/hub/local_server.py and the `hub` fixture (conftest.py)."""

import contextlib
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit


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
    sampler = trainer.engine.sampler
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


# ---- arguments and exact ε ------------------------------------------------------------------------------------
def dp_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), target_epsilon=4.0, target_delta=1e-4, report_to="none",
                save_strategy="no", disable_tqdm=True, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                weight_decay=0.0)
    return DPTrainingArguments(**{**base, **kw})


def gaussian_epsilon(sigma, steps, delta):
    """Exact ε of `steps` full-batch Gaussian steps (μ-GDP with μ = √steps/σ; Dong, Roth & Su)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    mu = math.sqrt(steps) / sigma
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 100)


# ---- privacy units (test_units, test_ddp) -------------------------------------------------------------------
# 6 users, 20 rows: "big" has 11 rows, more than a micro-batch of 10 (2 micro-batches), so it always spans
# micro-batches; "solo" has 1 row, the others 2 each.
USERS = ["big"] * 11 + ["solo"] + ["u1", "u1", "u2", "u2", "u3", "u3", "u4", "u4"]


def user_dataset(digits, users=USERS):
    rows = digits["train"].select(range(len(users))).with_format(None).to_dict()
    rows["user_id"] = list(users)
    return Dataset.from_dict(rows).with_format("torch", columns=["pixel_values", "labels"], output_all_columns=True)


def norm_of_difference(a, b):
    return torch.sqrt(sum(((a[n] - b[n]).double() ** 2).sum() for n in a)).item()


def brute_force_unit_sum(dataset, clip):
    """Σ over users of clip_C(gradient of the sum of the user's row losses), each user computed alone."""
    model = tiny_vit(num_labels=10, seed=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    users = list(dataset["user_id"])
    total = [torch.zeros_like(p) for p in params]
    for user in dict.fromkeys(users):
        rows = [i for i, u in enumerate(users) if u == user]
        loss = sum(model(pixel_values=dataset[i]["pixel_values"][None], labels=dataset[i]["labels"][None]).loss
                   for i in rows)
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        total = [t + g * min(1.0, clip / (norm + 1e-6)) for t, g in zip(total, grads)]
    return dict(zip(names, total))


def launch_two_workers(worker: str, out, env: dict, timeout: int, accelerate: bool = False) -> str:
    """`torch.distributed.run` 2 processes of tests/`worker` (argument: `out`), in a session of its own: on a timeout
    (a lost collective) the launcher AND its workers are killed and the test fails with the log's end. With
    `accelerate`: `accelerate launch` with recipes/accelerate_configs/cpu_2proc.yaml, as the recipes document it.
    Returns the launch's output."""
    tests = Path(__file__).resolve().parent
    launcher = (["accelerate.commands.launch", "--config_file", str(ACCEL_CONFIG), "--main_process_port",
                 str(free_port())] if accelerate else
                ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    cmd = [sys.executable, "-m", *launcher, str(tests / worker), str(out)]
    launch = subprocess.Popen(cmd, cwd=tests, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        log, _ = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        log, _ = launch.communicate()
        raise AssertionError(f"the 2-process launch did not finish in {timeout} s (a collective lost?):\n"
                             + log[-5000:]) from None
    assert launch.returncode == 0, log[-8000:]
    return log


@contextlib.contextmanager
def printed_to(path: Path):
    """This process's file descriptors 1 and 2 (print, logging, warnings, C code) go to `path` meanwhile; on an
    error, the end of it is shown on the real stderr too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        else:
            failed = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed:
                print(f"---- {path} ----\n{path.read_text()[-6000:]}", file=sys.stderr, flush=True)


def printed_by_ranks(folder: Path, name: str, ranks: int = 2) -> str:
    """What each of `ranks` processes printed under `printed_to(folder / f"{name}.rank<R>.txt")`, rank after rank (a
    rank's missing file fails here, naming it)."""
    return "".join((folder / f"{name}.rank{r}.txt").read_text() for r in range(ranks))
