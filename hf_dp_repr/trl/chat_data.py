"""Chat data that ships, for offline DP SFT: a tokenizer with a chat template and conversations of "users".

- `chat_tokenizer(texts)`: a byte-level BPE tokenizer trained locally with `tokenizers` on `texts` (public text:
  never the private conversations), with the special tokens of a small chat format and a Jinja chat template whose
  assistant turns sit inside `{% generation %}` markers, so `assistant_only_loss=True` (TRL's
  `return_assistant_tokens_mask`) finds the assistant's tokens;
- `stdlib_conversations()`: conversations built from the docstrings that ship with Python. Each user is one module
  of the standard library (`user_id`); each conversation asks about one of its functions or classes and the
  assistant answers with the first paragraph of its docstring, sometimes over two turns. A user has many
  conversations of different lengths: with `privacy_unit="user_id"` DP-SGD protects a whole user.

Example:
    >>> from hf_dp_repr.trl.chat_data import chat_tokenizer, stdlib_conversations
    >>> chats = stdlib_conversations(max_conversations=40)
    >>> sorted(chats.column_names), chats[0]["messages"][0]["role"]
    (['messages', 'user_id'], 'user')
    >>> tok = chat_tokenizer(["Hello there, how are you?"] * 10, vocab_size=300)
    >>> out = tok.apply_chat_template(chats[0]["messages"], return_dict=True, return_assistant_tokens_mask=True)
    >>> 0 < sum(out["assistant_masks"]) < len(out["input_ids"])
    True
"""

from __future__ import annotations

import re

from datasets import Dataset

from ..data import STDLIB_MODULES, stdlib_docstrings

USER, ASSISTANT, END, PAD = "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"
# Each turn: role token, text, end token. The assistant's text and end token are what it generates (the loss of
# assistant_only_loss); add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}" + ASSISTANT + "{% generation %}{{ message['content'] }}" + END
    + "{% endgeneration %}"
    "{% else %}" + USER + "{{ message['content'] }}" + END + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def chat_tokenizer(texts, vocab_size: int = 512):
    """A fast HF tokenizer (byte-level BPE trained on `texts`) with `CHAT_TEMPLATE` and its special tokens; EOS is
    the end of a turn, so `generate()` stops after the assistant's answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, USER, ASSISTANT, END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(list(texts), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END, pad_token=PAD,
                                  additional_special_tokens=[USER, ASSISTANT])
    tok.chat_template = CHAT_TEMPLATE
    return tok


# Modules whose docstrings are the PUBLIC text a tokenizer may be trained on: none is a "user" of the conversations.
PUBLIC_MODULES = ("io", "math", "time", "types", "weakref", "operator", "glob", "fnmatch", "tempfile", "hashlib",
                  "base64", "struct", "queue", "sched", "uuid", "ipaddress", "mimetypes", "socket", "sqlite3",
                  "urllib.parse", "http.client", "xml.dom.minidom", "asyncio.queues", "codecs", "locale")


def public_text() -> list[str]:
    """Docstrings of `PUBLIC_MODULES` and their public members (disjoint from the conversations' modules)."""
    import importlib
    import inspect

    assert not set(PUBLIC_MODULES) & set(STDLIB_MODULES)
    texts = []
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        members = [module] + [obj for attr, obj in sorted(vars(module).items()) if not attr.startswith("_")
                              and (inspect.isclass(obj) or inspect.isfunction(obj))]
        texts += [doc for doc in map(inspect.getdoc, members) if doc]
    return texts


def _first_paragraph(doc: str, max_chars: int) -> str:
    text = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
    return text[:max_chars].rsplit(" ", 1)[0] if len(text) > max_chars else text


def stdlib_conversations(max_conversations: int | None = None, max_chars: int = 200,
                         max_per_user: int | None = None, modules: tuple[str, ...] | None = None) -> Dataset:
    """Conversations (`messages`, `user_id`) from the standard library's docstrings (see the module docstring):
    per module (user), its members' docstrings in order, at most `max_per_user` of them; every third conversation
    has a second turn asking for more."""
    rows, seen, per_user = [], set(), {}
    for module, doc in stdlib_docstrings():
        if (modules is not None and module not in modules) or per_user.get(module, 0) == max_per_user:
            continue
        first = _first_paragraph(doc, max_chars)
        if len(first) < 20 or first in seen:
            continue
        seen.add(first)
        subject = first.split(" ")[0].strip(".,:;")
        messages = [{"role": "user", "content": f"In {module}, what does this do: {subject}?"},
                    {"role": "assistant", "content": first}]
        rest = [p for p in doc.split("\n\n")[1:] if len(p.strip()) >= 20]
        if len(rows) % 3 == 2 and rest:
            messages += [{"role": "user", "content": "Tell me more."},
                         {"role": "assistant", "content": _first_paragraph(rest[0], max_chars)}]
        rows.append({"messages": messages, "user_id": module})
        per_user[module] = per_user.get(module, 0) + 1
        if max_conversations is not None and len(rows) >= max_conversations:
            break
    return Dataset.from_list(rows)
