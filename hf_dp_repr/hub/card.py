"""The DP model card: a Jinja template in `model_cards/` rendered through `huggingface_hub.ModelCard` (the values it
is rendered with: `card_values`).

`DPTrainer` writes `README.md` (this card) next to every saved model, after the privacy ledger, so that what is
pushed to the Hub states the guarantee: ε (from the accountant), δ, accountant, σ (or one row per phase),
clipping norm, sampling, steps, epochs, dataset size, public vs private data, trained scope, library versions,
evaluation metrics (`all_results.json`) and the representation-law fits (`representation_law.json`).

The card and the ledger state n (and the sample rate, steps and epochs, which reveal it), so the guarantee the card
states is the one that holds with n public: for replace-one neighbours. A run planned for add/remove neighbours
gets its replace-one ε (dp_accounting's PLD on the same history) as the headline, and its add/remove ε beside it
with the condition it needs. A model selected by a hyperparameter search on the private data (`hp_search.json`
beside it) states the whole search's ε. Every ε is rounded up, never down.

What the trainer cannot know, the caller declares with `DPTrainer(..., model_card_info=ModelCardInfo(...))`
(all fields optional; see `ModelCardInfo`). It is kept in the card's metadata (`hf_dp_repr`), so that
`refresh_model_card(folder)` (e.g. `hf-dp-repr push`) renders the card again from the folder alone.

A run with `noise_multiplier=0` gets a card that says what it is: a non-private reference, tagged
`non-private-reference`, with no DP tag and no DP claim.

Example (a ledger as `PrivacyLedger.to_dict()` writes it; ε computed by the accountant):
    >>> from hf_dp_repr.privacy.accounting import compute_epsilon
    >>> led = dict(accountant="prv", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
    ...     dataset_size=6400, poisson_sampling=True, target_epsilon=3.0, planned_steps=100, steps_done=100,
    ...     phases=[dict(name="train", noise_multiplier=1.1, sample_rate=0.01, steps=100, expected_batch_size=64)],
    ...     history=[(1.1, 0.01, 100)], epsilon=compute_epsilon([(1.1, 0.01, 100)], 1e-5))
    >>> card = render_model_card(led, model_card_info=ModelCardInfo(private_data="my records"))
    >>> "differential-privacy" in card.data.tags, "my records" in card.text, "| noise multiplier σ | 1.1 |" in card.text
    (True, True, True)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..errors import ArgumentTypeError, LedgerError
from ..privacy.ledger import LEDGER_FILE
from .card_values import audit_row, exposure_rows, format_epsilon, template_values  # noqa: F401  (format_epsilon: public here)
from .public_names import cached_hub_id, is_local_path, public_text

TEMPLATE_NAME = "dp_model_card.md"
RESULTS_FILE = "all_results.json"
LAW_FILE = "representation_law.json"
CANARY_AUDIT_FILE = "canary_audit.json"  # opt-in: hf_dp_repr.audit.canaries.save_canary_audit
EXPOSURE_FILE = "canary_exposure.json"  # hf-dp-repr audit exposure: the DP model's canary exposures
SEARCH_FILE = "hp_search.json"  # a private hyperparameter search's cost, beside the trial it selected
CARD_FILE = "README.md"
TAGS = ["differential-privacy", "dp-sgd", "opacus", "hf-dp-repr"]
NON_PRIVATE_TAGS = ["non-private-reference", "hf-dp-repr"]
META_KEY = "hf_dp_repr"  # card metadata: what the card was rendered from, besides the folder's files
ENGINES = {  # DPTrainer.clipping_engine: what clipped the per-example gradients (same clipping, same guarantee)
    "ghost": "per-example clipping by ghost norms and book-keeping, hf-dp-repr's ghost clipping engine",
    "hooks": "per-example clipping on Opacus' per-sample gradient hooks",
}
# The card keywords of `Trainer.push_to_hub` / `Trainer.create_model_card` → the ModelCardInfo field that states them.
TRAINER_CARD_ARGS = {"model_name": "model_name", "license": "license", "language": "language", "tags": "tags",
                     "finetuned_from": "base_model", "dataset": "datasets", "dataset_tags": "datasets"}
_LISTS = ("datasets", "language", "tags")


@dataclass(frozen=True)
class ModelCardInfo:
    """What the DP model card says that the trainer cannot know: `DPTrainer(..., model_card_info=ModelCardInfo(...))`.

    `model_name`: what was fine-tuned on what (the card's title adds whether it is differentially private);
    `base_model`: Hub name, for the card's metadata; `base_model_description`: free text; `datasets`: Hub dataset
    ids, for the metadata; `private_data` / `public_data`: one-line descriptions; `analysis_data`: what the
    representation laws were measured on; `training_example`: what one example (row) is, e.g. "one conversation";
    `loss_tokens`: which of its tokens the loss saw (both set by the `hf_dp_repr.trl` trainers); `license`,
    `language`, `tags` (added to the DP tags): card metadata.
    A local path in any of them is published as its last component only (`public_names.public_text`).
    """

    model_name: str | None = None
    base_model: str | None = None
    base_model_description: str | None = None
    datasets: tuple[str, ...] = ()
    private_data: str | None = None
    public_data: str | None = None
    analysis_data: str | None = None
    training_example: str | None = None
    loss_tokens: str | None = None
    license: str | None = None
    language: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()

    @classmethod
    def from_value(cls, value: ModelCardInfo | dict | None) -> ModelCardInfo:
        """`value` as a ModelCardInfo (a dict of the same keys, or None, is accepted); unknown keys are refused."""
        if isinstance(value, cls):
            return value
        value = dict(value or {})
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ArgumentTypeError(f"model_card_info: unknown field(s) {sorted(unknown)}; ModelCardInfo has "
                                    f"{[f.name for f in fields(cls)]}.")
        return cls(**{**value, **{k: _as_tuple(value.get(k)) for k in _LISTS}})

    def to_dict(self) -> dict:
        """The fields that are set (what the card's metadata keeps)."""
        return {k: (list(v) if k in _LISTS else v) for k, v in asdict(self).items() if v not in (None, (), [])}

    def with_trainer_card_args(self, **kwargs) -> ModelCardInfo:
        """This info updated with the card keywords of `Trainer.push_to_hub` / `create_model_card` (`license`, `tags`,
        `language`, `model_name`, `finetuned_from` → base_model, `dataset` / `dataset_tags` → datasets); `tasks` and
        `dataset_args` (the Trainer's model-index of results) are refused, as is any other keyword."""
        unknown = sorted(set(kwargs) - set(TRAINER_CARD_ARGS))
        if unknown:
            raise ArgumentTypeError(f"DPTrainer: push_to_hub / create_model_card got {unknown}, which the DP model "
                                    "card cannot state (tasks and dataset_args fill the Trainer's model-index of "
                                    "results, which the DP card replaces by its own Evaluation table); it takes "
                                    f"{sorted(TRAINER_CARD_ARGS)}, hub_model_id, and everything else through "
                                    "model_card_info=ModelCardInfo(...).")
        updates = self.to_dict()
        for key, value in kwargs.items():
            field_ = TRAINER_CARD_ARGS[key]
            if field_ in _LISTS:
                value = tuple(dict.fromkeys(_as_tuple(updates.get(field_)) + _as_tuple(value)))
            updates[field_] = value
        return ModelCardInfo.from_value(updates)


def template_path() -> str:
    """Path of the card template: `model_cards/dp_model_card.md`, shipped in the package as `hub/templates/` (a
    symbolic link in the repository; a copy of the file in a built wheel)."""
    return str(resources.files("hf_dp_repr.hub").joinpath("templates", TEMPLATE_NAME))


def write_model_card(trainer, output_dir: str | os.PathLike) -> ModelCard:
    """Render the DP model card of `trainer`'s run and save it as `output_dir/README.md`; returns the card.

    Reads the ledger from the trainer (or `output_dir/privacy_ledger.json`), the trained scope from
    `trainer.describe_scope()` if the trainer has it, eval metrics from `output_dir/all_results.json` and the
    law fits from `output_dir/representation_law.json` when those files exist.
    """
    output_dir = Path(output_dir)
    ledger = trainer.ledger.to_dict() if getattr(trainer, "ledger", None) is not None else _load_json(
        output_dir / LEDGER_FILE)
    if ledger is None:
        raise LedgerError(f"write_model_card: the trainer has no privacy ledger and {output_dir / LEDGER_FILE} does "
                          "not exist; train with DPTrainer before writing a DP model card.")
    describe = getattr(trainer, "describe_scope", None)
    scope = describe() if callable(describe) else "all parameters"
    info = ModelCardInfo.from_value(getattr(trainer, "model_card_info", None)).to_dict()
    model = getattr(trainer, "model", None)
    if "base_model" not in info and model is not None:
        info["base_model"] = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    output_dir.mkdir(parents=True, exist_ok=True)
    search = getattr(trainer, "_search_record", None)  # the model was selected by a private search: its cost
    if search:
        (output_dir / SEARCH_FILE).write_text(json.dumps(search, indent=2))
    elif (output_dir / SEARCH_FILE).is_file():
        (output_dir / SEARCH_FILE).unlink()  # from a model saved here before, not this one
    card = render_model_card(ledger, model_card_info=info, scope=scope, output_dir=output_dir,
                             engine=getattr(trainer, "clipping_engine", None))
    card.save(output_dir / CARD_FILE)
    return card


def refresh_model_card(folder: str | os.PathLike, *, write: bool = True) -> ModelCard:
    """Render the card of the run saved in `folder` again, from its ledger and files alone (the caller's
    `model_card_info` and the trained scope come from the metadata of the card already there, if any); saved as
    `folder/README.md` when `write`."""
    folder = Path(folder)
    try:
        ledger = _load_json(folder / LEDGER_FILE)
    except ValueError as err:
        raise LedgerError(f"{folder / LEDGER_FILE} is not valid JSON ({err}).") from None
    if ledger is None:
        raise LedgerError(f"{folder} has no {LEDGER_FILE}: not a run saved by DPTrainer.")
    meta = {}
    if (folder / CARD_FILE).is_file():
        meta = ModelCard.load(folder / CARD_FILE).data.to_dict().get(META_KEY) or {}
    card = render_model_card(ledger, model_card_info=meta.get("info"), scope=meta.get("scope", "all parameters"),
                             output_dir=folder, engine=meta.get("engine"),
                             base_model_local=meta.get("base_model_local"))
    if write:
        card.save(folder / CARD_FILE)
    return card


def render_model_card(ledger: dict, *, model_card_info: ModelCardInfo | dict | None = None,
                      scope: str = "all parameters", output_dir: str | os.PathLike | None = None,
                      engine: str | None = None, base_model_local: bool | None = None) -> ModelCard:
    """Render the card from a ledger dict (`PrivacyLedger.to_dict()`) and what `output_dir` holds. `engine`: the
    clipping engine that ran (`DPTrainer.clipping_engine`). No local path is published: a local base model is
    named by its folder's name and said to be local (`base_model_local`, also kept in the metadata)."""
    info = ModelCardInfo.from_value(model_card_info).to_dict()
    if info.get("base_model"):
        base_model_local = bool(base_model_local) or (is_local_path(info["base_model"])
                                                       and not cached_hub_id(info["base_model"]))
    if info.get("datasets"):  # Hub dataset ids only: a local dataset path is no id, not even cut short
        info["datasets"] = [d for d in info["datasets"] if not is_local_path(d)]
    info = {k: ([public_text(x) for x in v] if isinstance(v, list) else public_text(v)) for k, v in info.items()}
    results = _load_json(Path(output_dir) / RESULTS_FILE) if output_dir is not None else None
    laws = _load_json(Path(output_dir) / LAW_FILE) if output_dir is not None else None
    audit = _load_json(Path(output_dir) / CANARY_AUDIT_FILE) if output_dir is not None else None
    search = _load_json(Path(output_dir) / SEARCH_FILE) if output_dir is not None else None
    base_model = info.get("base_model")
    hub_base = base_model if _looks_like_hub_id(base_model) and not base_model_local else None
    datasets_ = [d for d in info.get("datasets", []) if _looks_like_hub_id(d)]
    values = template_values(ledger, info, scope, results, laws, search)
    values["canary_audit"] = audit_row(audit)
    values["exposure_audit"] = exposure_rows(_load_json(Path(output_dir) / EXPOSURE_FILE) if output_dir else None)
    values["engine_text"] = ENGINES.get(engine, "per-example clipping")
    if base_model_local:
        described = values["base_model_text"] != base_model
        values["base_model_text"] += (f" (loaded from a local folder, `{base_model}`, not from the Hub)" if described
                                      else " (a local folder, not a Hub model)")
    tags = list(TAGS if values["private"] else NON_PRIVATE_TAGS)
    meta = {"scope": scope, "info": {k: v for k, v in info.items() if v is not None}, "engine": engine,
            "base_model_local": base_model_local or None}
    card_data = ModelCardData(
        library_name="transformers", tags=tags + [t for t in info.get("tags", []) if t not in tags],
        base_model=hub_base, datasets=datasets_ or None, license=info.get("license"),
        language=info.get("language") or None, **{META_KEY: {k: v for k, v in meta.items() if v is not None}},
    )
    return ModelCard.from_template(card_data, template_path=template_path(), **values)


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _as_tuple(value) -> tuple:
    return () if not value else (value,) if isinstance(value, str) else tuple(value)


def _looks_like_hub_id(name) -> bool:
    """`org/name` or `name`, not a local path (which the Hub metadata must not carry)."""
    if not isinstance(name, str) or not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    return name.count("/") <= 1 and " " not in name
