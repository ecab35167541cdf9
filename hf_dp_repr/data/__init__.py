"""Stage 1, data: what goes into a run, before anything trains. The datasets that ship with the install
(`embedded`: sklearn's digits, the standard-library docstring corpus of `stdlib_corpus`, token blocks that never
cross documents, the bundled MiniLM), control-coded rows (`control_codes`), a locally trained tokenizer and
padded causal-LM rows (`tokenizer`), image folders and Hub image datasets (`images`), and the explained loading of a
broken model file (`model_files`). Nothing here knows about privacy or training; every later stage may import it.

`hf_dp_repr.data` serves the embedded datasets by name (`load_embedded`, `load_digits_dataset`, ...), as before
the package was arranged by pipeline stage.
"""

from .embedded import (
                       DIGITS,
                       DIGITS_OFFSET,
                       DIGITS_PIXEL_MAX,
                       DIGITS_SCALE,
                       DOCUMENT_ID,
                       EMBEDDED_ALIASES,
                       EMBEDDED_DATASETS,
                       MINILM,
                       STDLIB_BLOCKS,
                       STDLIB_MODULES,
                       STDLIB_PARAGRAPHS,
                       STDLIB_TOPICS,
                       adapter_base_path,
                       byte_tokenize,
                       document_blocks,
                       embedded_name,
                       load_digits_dataset,
                       load_embedded,
                       load_stdlib_blocks,
                       load_stdlib_paragraphs,
                       load_stdlib_topics,
                       resolve_model_path,
                       stdlib_docstrings,
                       stdlib_text,
                       unique_documents,
                       unique_paragraphs,
)

__all__ = ["DIGITS", "DIGITS_OFFSET", "DIGITS_PIXEL_MAX", "DIGITS_SCALE", "DOCUMENT_ID", "EMBEDDED_ALIASES",
           "EMBEDDED_DATASETS", "MINILM", "STDLIB_BLOCKS", "STDLIB_MODULES", "STDLIB_PARAGRAPHS", "STDLIB_TOPICS",
           "adapter_base_path", "byte_tokenize", "document_blocks", "embedded_name", "load_digits_dataset",
           "load_embedded",
           "load_stdlib_blocks", "load_stdlib_paragraphs", "load_stdlib_topics", "resolve_model_path",
           "stdlib_docstrings", "stdlib_text", "unique_documents", "unique_paragraphs"]
