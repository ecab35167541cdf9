"""Seed 004's comparison on the embedded language task: DP from scratch, public only, and public → private
(switch at a fixed step and automatic by the decelerator), at the same ε. Prints a perplexity table and saves
the tr(H) curves (`tr_h.png`) and `results.json` under --output_dir.

    python recipes/seed004_continual.py --output_dir out/seed004 --target_epsilon 8 --max_steps 40 \
        --public_max_steps 60

Data and model as `dp_causal_lm.py` (stdlib docstrings, tokenizer trained on the public half, tiny GPT-2):
the private half is document-level (`privacy_unit="document_id"`), the public half is trained on without DP.
Every run uses the same seed for initialisation and the same DP plan (σ for the target ε over --max_steps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from hf_dp_repr.data import DOCUMENT_ID, document_blocks
from hf_dp_repr.scripts import causal_lm as lm
from hf_dp_repr.scripts import utils as ru
from hf_dp_repr.training.arguments import DPTrainingArguments
from hf_dp_repr.training.trainer import DPTrainer


@dataclass
class Seed004Arguments(lm.LMArguments):
    runs: str = field(default="dp_scratch,public_only,fixed,decelerator", metadata={
        "help": "Comma-separated runs: dp_scratch, public_only, fixed, decelerator."})


def main(argv: list[str] | None = None) -> dict:
    margs, targs, _push = ru.start_run((Seed004Arguments, DPTrainingArguments), argv)
    targs.privacy_unit = DOCUMENT_ID  # re-checked by dataclasses.replace below
    public_steps = targs.public_max_steps or 60
    docs, _ = lm.load_documents(margs)
    public_docs, private_docs = ru.split_public_private(docs["train"], 0.5, targs.seed)
    tokenizer = lm.load_or_train_tokenizer(margs, public_docs, save_dir=targs.output_dir)
    public = lm.to_blocks(public_docs, tokenizer, margs)
    private = document_blocks(private_docs, tokenizer, margs.block_size).with_format("torch")
    evals = lm.to_blocks(docs["eval"], tokenizer, margs)
    evals = evals.select(range(min(margs.max_eval_blocks or 256, len(evals))))
    public_eval = public.select(range(min(64, len(public))))
    results, records = {}, {}
    base = targs.output_dir
    for run in margs.runs.split(","):
        model = lm._load_model(margs.model_name_or_path, tokenizer, margs.block_size, targs.seed)
        out = os.path.join(base, run)
        if run == "public_only":
            from transformers import Trainer, TrainingArguments

            args = TrainingArguments(out, max_steps=public_steps, per_device_train_batch_size=32, report_to="none",
                                     learning_rate=margs.public_learning_rate,
                                     lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
                                     seed=targs.seed)
            trainer = Trainer(model=model, args=args, train_dataset=public, eval_dataset=evals)
            trainer.train()
            results[run] = dict(perplexity=math.exp(trainer.evaluate()["eval_loss"]), epsilon=0.0,
                                note="public data only: no private data, ε = 0")
            continue
        kw = dict(public_max_steps=0) if run == "dp_scratch" else dict(public_max_steps=public_steps, public_switch=run,
                                                  public_phase_learning_rate=margs.public_learning_rate)
        args = dataclasses.replace(targs, output_dir=out, save_strategy="no", **kw)
        trainer = DPTrainer(model=model, args=args, train_dataset=private, eval_dataset=evals,
                            **({} if run == "dp_scratch" else dict(public_train_dataset=public,
                                                                  public_eval_dataset=public_eval)))
        trainer.train()
        results[run] = dict(perplexity=math.exp(trainer.evaluate()["eval_loss"]), epsilon=trainer.epsilon(),
                            switch_step=(trainer.continual_record or {}).get("switch_step"))
        records[run] = trainer.continual_record
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, "results.json"), "w") as f:
        json.dump({"results": results, "records": records}, f, indent=2, default=str)
    _plot(records, os.path.join(base, "tr_h.png"))
    print("\n| run | eval perplexity | ε | switch step |\n|---|---|---|---|")
    for run, r in results.items():
        print(f"| {run} | {r['perplexity']:.2f} | {r['epsilon']:.3f} | {r.get('switch_step') or '-'} |")
    return results


def _plot(records: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for run, rec in records.items():
        pts = [(h["step"], h["hessian_trace"]) for h in (rec or {}).get("history", []) if "hessian_trace" in h]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=f"{run} (switch at {rec['switch_step']})")
    ax.set_xlabel("step (public, then private)")
    ax.set_ylabel("tr(H), public batch (Hutchinson)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    from .runner import run_recipe

    raise SystemExit(run_recipe("seed004_continual"))  # as recipes/*.py
