"""DP-SGD for TRL's `DPOTrainer`: `DPDPOTrainer` and its arguments `DPDPOConfig`.

One preference pair (prompt, chosen, rejected) is one example. It is what Poisson sampling draws, what the ledger
and the card count, and what is clipped: the pair's two sequences run through the model as two rows (TRL's
[chosen; rejected] batch), and their per-row gradients are summed and clipped as one unit of privacy
(`privacy.units`), so removing a pair moves the update by at most C/L, not 2C/L.

Why the pair's gradient is exact: TRL's DPO loss is the mean over the batch of per-pair terms ℓ(π_c, π_r, ref_c,
ref_r), each a function of its own pair's log-probabilities only (checked at the start of training on the first
pairs: the batch's loss × pairs equals the sum of each pair's loss alone). DP-SGD differentiates their sum; each
row's per-example gradient then carries its pair's factor ℓ'(·), and the two rows' sum is the pair's gradient.
Loss types that couple pairs (`aot`, `aot_unpaired` sort the batch; `sft` averages tokens over the batch) and MoE
auxiliary losses are refused before any work.

The reference model's log-probabilities carry no gradient: they are computed under `no_grad` before the policy's
forward (from `ref_model`; by default a frozen copy of the model as passed, so nothing is loaded by name; with a
fresh LoRA adapter, the base with the adapter disabled; `trl.reference`). With `precompute_ref_log_probs=True` they
are computed once, in memory, and never written to a cache file (TRL writes one next to the dataset's cache). Runs
on several processes (DDP) and sharded (FSDP2), a reference model sharded like the policy.

Example (conversational pairs, three DP steps of a tiny model; offline, seconds on a CPU):
    >>> from datasets import Dataset
    >>> from hf_dp_repr.tiny import tiny_llama
    >>> from hf_dp_repr.trl import DPDPOConfig, DPDPOTrainer
    >>> from hf_dp_repr.trl.chat_data import chat_tokenizer
    >>> tokenizer = chat_tokenizer(["What does len do?", "It counts items.", "No idea."] * 20, vocab_size=300)
    >>> def ask(text): return [{"role": "user", "content": text}]
    >>> def say(text): return [{"role": "assistant", "content": text}]
    >>> pairs = Dataset.from_dict({"prompt": [ask("What does len do?"), ask("And abs?")] * 8,
    ...                            "chosen": [say("It counts items."), say("The absolute value.")] * 8,
    ...                            "rejected": [say("No idea."), say("It sorts a list.")] * 8})
    >>> args = DPDPOConfig(output_dir="dp-dpo", target_epsilon=8.0, target_delta=1e-3, per_device_train_batch_size=4,
    ...                    max_steps=3, learning_rate=1e-3, report_to="none", save_strategy="no", disable_tqdm=True)
    >>> trainer = DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer)), args=args, train_dataset=pairs,
    ...                        processing_class=tokenizer)
    >>> out = trainer.train()  # doctest: +ELLIPSIS
    {...}
    >>> trainer.ledger.steps_done, trainer.ledger.plan.dataset_size, trainer.epsilon() <= 8.0
    (3, 16, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch
from trl import DPOConfig, DPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from ..errors import DPConfigError, NotPrivatizableError, UnsupportedError
from ..hub.card import ModelCardInfo
from ..privacy.batch_rows import RowsProbe, rows_per_example
from ..privacy.row_probe import ParameterUses, check_collator_keeps_examples_apart
from ..privacy.sampler import UNIT_KEY
from ..privacy.sharding import is_sharded
from ..privacy.units import ROW
from ..training.sharding import sharding_request
from .mechanism import dp_config_class, dp_trainer_class, load_model
from .reference import ReferenceStandIn, choose_reference, kept_requires_grad, prepare_reference

PAIR_KEYS = ("input_ids", "attention_mask", "completion_mask")  # TRL's per-sequence tensors: (2·pairs, T)
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
# TRL loss types whose batch loss is not a mean of per-pair terms, with why.
COUPLED_LOSSES = {
    "aot": "it sorts the batch's log-ratios, pairing each pair with another pair's rank",
    "aot_unpaired": "it sorts the batch's chosen and rejected log-ratios separately",
    "sft": "it averages the chosen tokens over the whole batch, so a pair's weight depends on the others' lengths",
}

# The private members of trl's DPOTrainer this module relies on (checked by tests/test_trl_dpo.py against the installed
# trl): name → (its parameters, text its caller's source must contain, the caller).
TRL_PRIVATE = {
    "_compute_loss": (("self", "model", "inputs", "return_outputs"), "self._compute_loss(", "compute_loss"),
    "_precompute_ref_logps": (("self", "dataset", "name", "batch_size"), "self._precompute_ref_logps(", "__init__"),
    "precompute_ref_logps": ((), "if self.precompute_ref_logps:", "_compute_loss"),  # then it reads the batch's
    # given a ref_model (the ReferenceStandIn), TRL makes no "ref" copy of a LoRA adapter (trl.reference)
    "ref_model": ((), "elif is_peft_model(model) and ref_model is None:", "__init__"),
}
PAIR_EXAMPLE = ("one preference pair (prompt, chosen, rejected); its chosen and rejected sequences are clipped "
                "together, as one unit")


def loss_tokens(args) -> str:
    """Which tokens the DPO loss saw, for the card."""
    cut = "" if args.max_length is None else (f", each sequence cut to {args.max_length} tokens "
                                              f"({args.truncation_mode})")
    return (f"the chosen and the rejected completion's tokens (their log-probabilities under the model, against the "
            f"frozen reference, in TRL's {'+'.join(args.loss_type)} loss with β={args.beta}); the prompt's tokens "
            f"as context only{cut}")


_DPDPOConfigBase = dp_config_class(DPOConfig, name="_DPDPOConfigBase")


class DPDPOConfig(_DPDPOConfigBase):
    """The arguments of a DP DPO run: every field of `trl.DPOConfig` and of `DPTrainingArguments`. `bf16` is on only
    where the device supports it, gradient checkpointing off (turn it on with `use_reentrant`). Loss types that
    couple the pairs of a batch (`COUPLED_LOSSES`) are refused."""

    def __post_init__(self):
        super().__post_init__()  # DPOConfig turns a single loss_type into a list
        if self.activation_offloading:
            raise DPConfigError("DPDPOConfig: activation_offloading=True wraps DPOTrainer's training step, which DP "
                                "training replaces, so it would do nothing. Fix: activation_offloading=False.")
        coupled = [t for t in self.loss_type if t in COUPLED_LOSSES]
        if coupled:
            raise DPConfigError(
                f"DPDPOConfig: loss_type={coupled[0]!r} cannot be trained with DP-SGD: {COUPLED_LOSSES[coupled[0]]}, "
                "so one pair would move the other pairs' clipped gradients. DP-SGD needs a loss that is a sum of "
                "per-pair terms. Fix: loss_type='sigmoid' (DPO), 'ipo', 'hinge', 'robust' or another per-pair loss.")


def pair_rows(batch: dict, pairs: int) -> dict:
    """TRL's preference batch (chosen rows, then rejected rows: (2·pairs, T)) with each pair as one row
    (pairs, 2, T), so that row i of every tensor is pair i."""
    return {k: v.reshape(2, pairs, *v.shape[1:]).transpose(0, 1).contiguous() if k in PAIR_KEYS else v
            for k, v in batch.items()}


def sequence_rows(batch: dict) -> dict:
    """The inverse of `pair_rows`: (pairs, 2, T) → TRL's (2·pairs, T), chosen rows first."""
    return {k: v.transpose(0, 1).reshape(-1, *v.shape[2:]) if k in PAIR_KEYS else v for k, v in batch.items()}


class PairCollator:
    """TRL's preference collator, with each pair's two sequences as one row of the batch (`pair_rows`)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        return pair_rows(self.collator(features), len(features))


@contextlib.contextmanager
def process_local_gathers(accelerator, off: bool = False):
    """TRL's loss gathers its metrics across processes on every call; DP-SGD skips the forward of an empty Poisson
    micro-batch, so such a collective would hang. Inside, `gather` / `gather_for_metrics` return this process's
    values (`off=True`: unchanged, e.g. in evaluation, where every process runs every batch)."""
    if off:
        yield
        return
    accelerator.gather = accelerator.gather_for_metrics = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        del accelerator.gather, accelerator.gather_for_metrics


def module_head(model) -> None:
    """Make the fused LM head that TRL adds (`trl.trainer.utils.add_fused_lm_head`) call the head module when the
    head trains: the fused kernel multiplies by `lm_head.weight` outside the module, where neither clipping engine
    sees the use. The log-probabilities (and TRL's per-token metrics) are then computed from the full logits."""
    from trl.trainer.utils import FusedCausalLMOutput

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or not any(p.requires_grad for p in head.parameters()):
        return  # a frozen head (LoRA, trained blocks): TRL's fused kernel is exact and lighter
    fused = base.forward  # TRL's patched forward: without fused_lm_head=True it is the model's own

    def forward(*args, fused_lm_head=False, labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs.pop("shift_labels", None)
        logits = fused(*args, **{**kwargs, "use_cache": False}).logits[:, :-1].float()
        labels = labels[:, 1:]
        mask = labels != -100
        log_softmax = logits.log_softmax(-1)
        log_probs = log_softmax.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(~mask, 0)
        with torch.no_grad():
            entropy = -(log_softmax.exp() * log_softmax).sum(-1).masked_fill(~mask, 0)
            log_sum_sq = torch.logsumexp(2 * log_softmax, -1).masked_fill(~mask, 0)
            mean_logits = logits.mean(-1).masked_fill(~mask, 0)
            is_top1 = (logits.argmax(-1) == labels) & mask
        return FusedCausalLMOutput(loss=-log_probs.sum() / mask.sum().clamp(min=1), log_probs=log_probs,
                                   entropy=entropy, log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits,
                                   is_top1=is_top1, label_mask=mask)

    base.forward = forward


class DPDPOTrainer(dp_trainer_class(DPOTrainer, config_class=DPDPOConfig)):
    """`trl.DPOTrainer` under DP-SGD (see the module docstring): the same arguments, with `args` a `DPDPOConfig`,
    and `model_card_info`. A pair is one example (or, with `privacy_unit`, all pairs of a unit are one unit).

    Logged in training: the loss (computed on private pairs, as DPTrainer logs it) and `epsilon`, the privacy spent.
    TRL's own metrics of the training pairs (`rewards/*`, `logps/*`, `logits/*`, `entropy`, `mean_token_accuracy`)
    are computed on private pairs outside DP-SGD: they are never logged (nor kept in `log_history`, nor sent to a
    tracker). Evaluation logs them for the eval set, like the eval loss.

    Sharded (FSDP2: `fsdp=True, fsdp_config={"fsdp_version": 2}` under `accelerate launch`) as DPTrainer shards; the
    reference is sharded the same way, or is the sharded policy itself (`trl.reference`)."""

    batch_has_labels = False  # the loss reads input_ids, attention_mask, completion_mask
    compute_loss_handled = True  # its compute_loss is evaluation's; training uses example_losses (training.overrides)

    def __init__(self, model=None, ref_model=None, args: DPDPOConfig | None = None, train_dataset=None,
                 peft_config=None, **kwargs):
        self._reference, trl_ref = None, ref_model  # the reference (None: the policy) and what TRL's init gets
        if isinstance(args, DPDPOConfig) and model is not None:
            model = load_model(model, args)  # (by name: loaded once, copied as the reference)
            sharded = sharding_request(args) is not None or is_sharded(model)
            if sharded and args.sync_ref_model:
                raise UnsupportedError("DPDPOTrainer: sync_ref_model=True is not tested on a sharded run (it mixes "
                                       "the sharded policy into the sharded reference). Fix: sync_ref_model=False, "
                                       "or run without fsdp.")
            self._reference, trl_builds = choose_reference(model, ref_model, peft_config, args, sharded)
            trl_ref = None if trl_builds else ReferenceStandIn(model.config)
        self._pair_counter = itertools.count()
        super().__init__(model=model, ref_model=trl_ref, args=args, train_dataset=train_dataset,
                         peft_config=peft_config, **kwargs)
        self._install_reference()
        if self.aux_loss_enabled:
            raise UnsupportedError("DPDPOTrainer: the MoE load-balancing loss is computed over the whole batch's "
                                   "router logits, which couples the pairs. Fix: router_aux_loss_coef=0.")
        module_head(self.model)
        self.data_collator = PairCollator(self.data_collator)
        info = ModelCardInfo.from_value(self.model_card_info)
        self.model_card_info = dataclasses.replace(
            info, training_example=info.training_example or PAIR_EXAMPLE,
            loss_tokens=info.loss_tokens or loss_tokens(self.args))

    # ---- the reference ------------------------------------------------------------------------------------------
    def _install_reference(self) -> None:
        """Replace TRL's `ReferenceStandIn` by the reference chosen at init (`trl.reference`), made ready (and sharded
        in a sharded run); TRL's sync_ref_model callback then syncs into it."""
        if not isinstance(self.ref_model, ReferenceStandIn):
            return
        if self._reference is not None:
            prepare_reference(self._reference, self.args, self.accelerator.device)
        self.ref_model = self._reference
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, SyncRefModelCallback):
                callback.ref_model = self.ref_model

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """The reference log-probabilities of every pair, computed once and added to the dataset in memory: never
        written to a cache file beside the dataset (which TRL does), outside the run's output folder."""
        from datasets import Dataset

        if not isinstance(dataset, Dataset):
            raise UnsupportedError("DPDPOTrainer: precompute_ref_log_probs needs a map-style datasets.Dataset.")
        self._install_reference()  # (called by TRL's init, before it returns)
        collate = self.data_collator.collator if isinstance(self.data_collator, PairCollator) else self.data_collator
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            with kept_requires_grad(self.model):
                c, r = self.compute_ref_log_probs(model, batch)
            chosen += c.float().cpu().tolist()
            rejected += r.float().cpu().tolist()
        return dataset.add_column(REF_KEYS[0], chosen).add_column(REF_KEYS[1], rejected)

    def _with_reference(self, inputs: dict) -> dict:
        """`inputs` (TRL's layout) with the reference's log-probabilities, computed without gradient if absent."""
        if REF_KEYS[0] in inputs:
            return inputs
        with torch.no_grad(), kept_requires_grad(self.model):
            chosen, rejected = self.compute_ref_log_probs(self.ref_model or self.model, inputs)
        return {**inputs, REF_KEYS[0]: chosen, REF_KEYS[1]: rejected}

    @contextlib.contextmanager
    def _reference_in_batch(self):
        saved = self.precompute_ref_logps
        self.precompute_ref_logps = True  # TRL's loss then reads the reference from the batch
        try:
            yield
        finally:
            self.precompute_ref_logps = saved

    # ---- DPTrainer's loss hooks ----------------------------------------------------------------------------
    def examples_in_batch(self, inputs: dict) -> int:
        """The model rows of a micro-batch of pairs: two per pair (the clipper sees rows; pairs are its units)."""
        return 2 * len(inputs["input_ids"])

    def row_units(self, inputs: dict, unit_ids: torch.Tensor | None) -> torch.Tensor:
        """Each model row's unit: its pair (ids unique in the run), or with a privacy_unit its pair's unit."""
        pairs = len(inputs["input_ids"])
        if unit_ids is None:
            start = next(self._pair_counter)
            self._pair_counter = itertools.count(start + pairs)
            unit_ids = torch.arange(start, start + pairs)
        return torch.cat([unit_ids, unit_ids])

    def pair_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's DPO loss of a batch of pairs (TRL's layout): the mean of the pairs' losses."""
        inputs = self._with_reference(inputs)
        with self._reference_in_batch(), process_local_gathers(self.accelerator):
            return self._compute_loss(model, inputs, return_outputs=False)

    def example_losses(self, model, inputs: dict, states=None) -> torch.Tensor:
        """The micro-batch's loss as one value per pair whose sum is the sum of the pairs' losses (TRL returns their
        mean; the sum is what DP-SGD differentiates, and each pair's gradient is clipped as one unit)."""
        pairs = len(inputs["input_ids"])
        return self.pair_loss(model, sequence_rows(inputs)).expand(pairs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation: TRL's loss on pairs given one per row (`PairCollator`)."""
        if inputs["input_ids"].dim() == 3:
            inputs = sequence_rows(inputs)
        with process_local_gathers(self.accelerator, off=not self.model.training):
            inputs = self._with_reference(inputs)
            with self._reference_in_batch():
                return self._compute_loss(model, inputs, return_outputs)

    # ---- the start-of-training probe, for pairs ----------------------------------------------------------------
    def probe_rows(self, dataset, collate, scope=None) -> set[str]:
        """The probe of `privacy.row_probe` for pairs: the collator keeps pairs apart; no trained tensor is used
        outside its module (TRL's fused LM head would be); the rows of every trained module follow the model's
        rows (a pair's two sequences); and the batch loss × pairs is the sum of each pair's loss alone."""
        examples = [dataset[i] for i in range(min(3, len(dataset)))]
        batch = check_collator_keeps_examples_apart(collate, examples)
        batch = self._prepare_inputs({k: v for k, v in batch.items() if k != UNIT_KEY})
        rows = sequence_rows(batch)
        model = self.model
        training, trained = model.training, {p: p.requires_grad for p in model.parameters()}
        if scope is not None:
            scope.apply(model)
        model.eval()
        try:
            rows = self._with_reference(rows)  # before: PEFT's adapter switch sets requires_grad (not a use)
            with ParameterUses(model) as uses:  # (with gradients: it records the uses that would carry one)
                together = self.pair_loss(model, rows).detach() * len(examples)
            with torch.no_grad():
                alone = sum(self.pair_loss(model, sequence_rows(self._prepare_inputs(collate([e]))))
                            for e in examples)
            n = len(rows["input_ids"])
            order = [0, *range(n - 1, 0, -1), 0]  # the rows reordered, then a copy of the first
            model_inputs = {k: rows[k] for k in ("input_ids", "attention_mask")}
            first, second = RowsProbe(model, n, copy=False), RowsProbe(model, n + 1, copy=True)
            with first, torch.no_grad():
                model(**model_inputs)
            with second, torch.no_grad():
                model(**{k: v[order] for k, v in model_inputs.items()})
        finally:
            self._metrics["eval"].clear()  # TRL's metrics of the probe's forwards
            model.train(training)
            for p, flag in trained.items():
                p.requires_grad_(flag)
        if uses.outside:
            listed = ", ".join(f"{name} (by {op})" for name, op in uses.outside.items())
            raise NotPrivatizableError(f"DPDPOTrainer: trained parameters are used outside a call of the module that "
                                       f"owns them: {listed}; neither clipping engine would see that use.")
        if not torch.allclose(together.double(), alone.double(), rtol=1e-4, atol=1e-6):
            raise NotPrivatizableError(
                f"DPDPOTrainer: the DPO loss of {len(examples)} pairs together ({together.item():.6g} summed) is not "
                f"the sum of each pair's loss alone ({alone.item():.6g}): the loss couples the pairs of a batch, so "
                "one pair would move the others' clipped gradients. Fix: a per-pair loss_type (e.g. 'sigmoid').")
        return rows_per_example(first, second)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        engine = self.engine
        # a pair's two rows are collated together, so a micro-batch never cuts a pair: the ghost engine may clip
        # pairs as units (with a privacy_unit, units of pairs may span micro-batches: the hooks engine carries them)
        if engine.plan.privacy_unit == ROW:
            engine.optimizer.whole_units = True
        return optimizer
