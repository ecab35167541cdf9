"""The recipes' code, importable and tested (as TRL's `trl.scripts`): `recipes/*.py` and `hf-dp-repr train
{image,lm,text}` call `main()` of `image_classification`, `causal_lm` and `text_classification`.

Shared parts: `runner` (the one way into every recipe: one-line refusals, `--help` at once), `usage` (the
recipes' `--help`), `arguments` (script / data / public pre-training arguments, the `--config` parser), `utils` (data
loading, metrics, public pre-training, the start and end of a run), `checks` (what is refused before any work),
`report` (what is shown during and after a run).

Importing the package sets up the process (`hf_dp_repr.entry_point`: OMP_WAIT_POLICY=PASSIVE, ...), so every way
into a recipe (`recipes/*.py`, `hf-dp-repr train`, `python -m hf_dp_repr.scripts.NAME`) does so before torch loads.
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()
