"""What leaves the machine names no local path: the model card's free text and metadata, and a LoRA run's
`adapter_config.json` (peft records the base model's `name_or_path`, e.g. the temporary folder of public
pre-training). A local path becomes its last component (a cached GGUF model, its shipped name: `smollm2-135m-instruct`,
which `resolve_model_path` loads again); Hub ids and URLs are kept. Nor a private metric (`is_private_metric`):
metrics files, the card and pushes keep none.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..data.gguf_models import shipped_name

ADAPTER_CONFIG = "adapter_config.json"
PRIVATE_PREFIX = "train_"  # metrics computed on the private training data outside DP-SGD
UNIT_WORDS = {"tokens", "samples", "examples", "rows", "sequences", "units"}


def is_sample_counter(key: str) -> bool:
    """A count of what the training batches held, whoever computed it: `total_flos` (6 · parameters · Σ|B_t|),
    `num_input_tokens_seen`, TRL's `num_tokens` (`eval_num_tokens`: its running count of TRAINING tokens), ...: the
    sizes of the secret Poisson batches, which the accountant treats as secret. The rule: a name with the word
    `flos` or `seen`, or `num` / `total` with a unit (tokens, samples, examples, rows, sequences, units).

    >>> [is_sample_counter(k) for k in ("total_flos", "num_input_tokens_seen", "eval_num_tokens", "eval_samples",
    ...                                 "eval_samples_per_second", "eval_mean_token_accuracy")]
    [True, True, True, False, False, False]
    """
    words = set(re.split(r"[_/.\-]", key.lower()))
    return bool(words & {"flos", "seen"}) or bool(words & {"num", "total"} and words & UNIT_WORDS)


def is_private_metric(key: str) -> bool:
    """`train_*` metrics (the training loss, the metrics of an evaluation set drawn from the training data, named
    `train_eval_*`, ...) are computed on the private data outside DP-SGD; counters of the training batches' rows or
    tokens (`is_sample_counter`) give the secret batch sizes."""
    return key.startswith(PRIVATE_PREFIX) or is_sample_counter(key)


def public_text(text):
    """`text` with every local path in it (absolute, ./ ../ ~/, two or more slashes, or an existing file) replaced by
    its last component: a card never publishes where things lie on this machine. Hub ids and URLs are kept.

    >>> public_text("tiny_vit pre-trained in /tmp/tmpab12/public_pretrained, on ../data/x.npz, from google/vit")
    'tiny_vit pre-trained in public_pretrained, on x.npz, from google/vit'
    >>> public_text("/home/me/.cache/huggingface/hub/models--google--vit-base/snapshots/0a1b2c")
    'google/vit-base'
    >>> public_text("/root/.cache/huggingface/hf_dp_repr/smollm2-135m-instruct-0.1.2")  # (data.gguf_models)
    'smollm2-135m-instruct'
    """
    if not isinstance(text, str):
        return text
    return re.sub(r"[^\s`'\"(),;\[\]]+", lambda m: _public_token(m.group(0)), text)


def _public_token(token: str) -> str:
    end = len(token.rstrip(".:")) if len(token) > 1 else len(token)
    word, tail = token[:end], token[end:]
    if not is_local_path(word):
        return token
    return (shipped_name(word) or cached_hub_id(word) or Path(word).name or word) + tail


def cached_hub_id(path: str) -> str | None:
    """The Hub id of a model folder in the Hugging Face cache (`.../models--org--name/snapshots/<sha>`), else None."""
    cached = re.search(r"models--([^/]+)--([^/]+)/snapshots/", path)
    return f"{cached[1]}/{cached[2]}" if cached else None


def is_local_path(name: str) -> bool:
    """A path on this machine rather than a Hub id (`org/name`, `name`) or a URL."""
    if "://" in name:
        return False
    if "/" not in name:  # a bare name is a Hub id unless a model folder of that name is here (from_pretrained's rule)
        return os.path.isfile(os.path.join(name, "config.json"))
    return name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2 or os.path.exists(name)


def public_adapter_config(folder: str | os.PathLike) -> None:
    """Rewrite `folder/adapter_config.json`'s `base_model_name_or_path` to its last component when it is a local
    path (load such adapters with `PeftModel.from_pretrained(base_model, folder)`); a Hub id is kept."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and is_local_path(base):
        config["base_model_name_or_path"] = public_text(base)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
