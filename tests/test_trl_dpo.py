"""DPDPOTrainer: one preference pair is one example, its two sequences clipped as one unit.

The brute force runs each sampled pair alone in float64: its two sequences through the policy and the frozen
reference, TRL's sigmoid DPO loss -log σ(β((π_c − ref_c) − (π_r − ref_r))), the gradient, clipped to C, summed,
divided by L. One σ = 0 step of the trainer must give the same update.
"""

import copy
import os
import string
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import TrainerCallback

from hf_dp_repr.tiny import tiny_llama
from utils import CaptureUpdate, relative_error

pytest.importorskip("trl")

from hf_dp_repr.trl.dpo import DPDPOConfig, DPDPOTrainer  # noqa: E402

BETA, PER_DEVICE, ACCUMULATION = 0.5, 3, 2  # 12 pairs, L = 6: q = 0.5


def char_tokenizer():
    """A character-level tokenizer (pad 0, eos 1) built offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<pad>", "</s>", "<unk>", *string.ascii_lowercase, *" .,?!"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


PROMPTS = ["hi ", "what is it? ", "say ", "why? ", "a b c ", "tell me, "]
CHOSEN = ["yes", "a cat.", "ok", "because it is.", "d", "a long story, with words"]
REJECTED = ["no!", "dog", "never ever", "no", "e f g h", "x"]


def pairs(n=12):
    k = len(PROMPTS)
    return Dataset.from_dict({"prompt": [PROMPTS[i % k] for i in range(n)],
                              "chosen": [CHOSEN[(i + i // k) % k] for i in range(n)],
                              "rejected": [REJECTED[(2 * i + 1) % k] for i in range(n)]})


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def dpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=PER_DEVICE,
                gradient_accumulation_steps=ACCUMULATION, max_steps=1, learning_rate=0.1, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, report_to="none", save_strategy="no",
                disable_tqdm=True, seed=3, noise_seed=3, target_delta=1e-3, beta=BETA)
    return DPDPOConfig(**{**base, **kw})


def one_step(model, tokenizer, tmp_path, data=None, trainer_kw=None, **kw):
    """The update of one DP step (p.grad after it) and the pairs of its logical batch."""
    capture, trainer_kw = CaptureUpdate(), dict(trainer_kw or {})
    trainer = DPDPOTrainer(model=model, args=dpo_args(tmp_path, **kw), train_dataset=data or pairs(),
                           processing_class=tokenizer, callbacks=[capture, *trainer_kw.pop("callbacks", [])],
                           **trainer_kw)
    trainer.train()
    sampler = trainer.engine.sampler
    sampler.set_epoch(0)
    batch = [i for chunk in list(sampler)[:ACCUMULATION] for i in chunk]
    return capture.grads, batch, trainer


def tokenized(model, tokenizer, tmp_path):
    """The pairs as TRL tokenises them (prompt_ids, chosen_ids, rejected_ids)."""
    args = dpo_args(tmp_path / "tokenized", noise_multiplier=0.0)
    return DPDPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=pairs(),
                        processing_class=tokenizer).train_dataset


def sequence_logp(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
    targets = ids[0, 1:]
    start = len(prompt_ids) - 1  # position t predicts token t + 1
    return logp[start:].gather(-1, targets[start:, None]).sum()


def pair_gradients(policy, reference, dataset, rows):
    """Each pair's DPO-loss gradient, computed alone (float64)."""
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    params = [p for _, p in policy.named_parameters() if p.requires_grad]
    out = []
    for i in rows:
        row = dataset[i]
        with torch.no_grad():
            ref_c = sequence_logp(reference, row["prompt_ids"], row["chosen_ids"])
            ref_r = sequence_logp(reference, row["prompt_ids"], row["rejected_ids"])
        margin = (sequence_logp(policy, row["prompt_ids"], row["chosen_ids"]) - ref_c
                  - sequence_logp(policy, row["prompt_ids"], row["rejected_ids"]) + ref_r)
        loss = -F.logsigmoid(BETA * margin)
        out.append(dict(zip(names, torch.autograd.grad(loss, params))))
    return out


def norm(grads):
    return torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()


def clipped_sum(grads, clip):
    total = {n: torch.zeros_like(g) for n, g in grads[0].items()}
    for g in grads:
        factor = min(1.0, clip / norm(g))
        total = {n: total[n] + factor * g[n] for n in total}
    return total


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_sigma0_update_equals_the_per_pair_clipped_brute_force(engine, tokenizer, tmp_path):
    """Full fine-tuning of a tiny Llama (its lm_head trains: TRL's fused head is replaced by the module's)."""
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    policy64 = copy.deepcopy(model).double()
    reference64 = copy.deepcopy(model).double().eval()
    # C between the pairs' gradient norms: some pairs are clipped, some are not
    probe = tokenized(model, tokenizer, tmp_path)
    norms = sorted(norm(g) for g in pair_gradients(policy64, reference64, probe, range(len(probe))))
    clip = norms[len(norms) // 2]
    got, batch, trainer = one_step(model, tokenizer, tmp_path, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                   clipping_engine=engine)
    assert trainer.engine.clipping_engine == engine
    grads = pair_gradients(policy64, reference64, trainer.train_dataset, batch)
    assert any(norm(g) > clip for g in grads) and any(norm(g) < clip for g in grads)
    L = PER_DEVICE * ACCUMULATION
    want = {n: g / L for n, g in clipped_sum(grads, clip).items()}
    assert relative_error(got, want) < 1e-4
    # clipped row by row (chosen and rejected apart), the update would be another one
    assert trainer.ledger.plan.dataset_size == 12


def summed_update(model, tokenizer, tmp_path, data, clip):
    """L × the σ = 0 update of one step with sample rate 1 (every pair in the batch)."""
    got, batch, trainer = one_step(model, tokenizer, tmp_path, data=data, noise_multiplier=0.0,
                                   per_sample_max_grad_norm=clip, per_device_train_batch_size=len(data),
                                   gradient_accumulation_steps=1)
    assert trainer.ledger.plan.phases[0].sample_rate == 1.0 and sorted(batch) == list(range(len(data)))
    return {n: g * len(data) for n, g in got.items()}, trainer


def row_gradient(policy, reference, row, chosen: bool):
    """The gradient that reaches one sequence's row: the pair's loss with the other sequence's log-prob frozen."""
    params = [p for p in policy.parameters() if p.requires_grad]
    with torch.no_grad():
        ref = {k: sequence_logp(reference, row["prompt_ids"], row[k]) for k in ("chosen_ids", "rejected_ids")}
        frozen = {k: sequence_logp(policy, row["prompt_ids"], row[k]) for k in ("chosen_ids", "rejected_ids")}
    live = "chosen_ids" if chosen else "rejected_ids"
    logp = {**frozen, live: sequence_logp(policy, row["prompt_ids"], row[live])}
    margin = logp["chosen_ids"] - ref["chosen_ids"] - logp["rejected_ids"] + ref["rejected_ids"]
    return torch.autograd.grad(-F.logsigmoid(BETA * margin), params)


def test_removing_a_pair_moves_the_sigma0_update_by_C_over_L_not_2C(tokenizer, tmp_path):
    """q = 1, a C far below every pair's gradient norm: the summed update moves by exactly C when a pair goes. Its
    two rows clipped apart would move it by |clip(g_chosen) + clip(g_rejected)|, up to 2C (checked to differ)."""
    clip, data, removed = 1e-3, pairs(6), 4
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    policy64, reference64 = copy.deepcopy(model).double(), copy.deepcopy(model).double().eval()
    full, trainer = summed_update(copy.deepcopy(model), tokenizer, tmp_path / "full", data, clip)
    less, _ = summed_update(model, tokenizer, tmp_path / "less",
                            data.select([i for i in range(len(data)) if i != removed]), clip)
    moved = torch.sqrt(sum(((full[n] - less[n]).double() ** 2).sum() for n in full)).item()
    assert clip * 0.999 <= moved <= clip * 1.001
    row = trainer.train_dataset[removed]
    rows = [row_gradient(policy64, reference64, row, chosen) for chosen in (True, False)]
    apart = [clip * g / torch.sqrt(sum((x ** 2).sum() for x in gs)) for gs in rows for g in gs]
    half = len(apart) // 2
    apart_norm = torch.sqrt(sum(((a + b) ** 2).sum() for a, b in zip(apart[:half], apart[half:]))).item()
    assert abs(apart_norm - clip) > 0.1 * clip  # the test has teeth: row-by-row clipping moves it elsewhere


def dp_accounting_epsilon(sigma, q, steps, delta, neighboring):
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    relation = dp_accounting.NeighboringRelation
    accountant = PLDAccountant(relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def test_noise_has_std_sigma_c_over_L_and_epsilon_is_dp_accountings_over_pairs(tokenizer, tmp_path):
    """The noise of one step has std σC/L per coordinate; 12 pairs with L = 6 pairs per step is q = 0.5 over pairs
    (24 sequences would give 0.25), and ε is dp_accounting's for that plan."""
    sigma, clip = 2.0, 0.5
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    clean, batch_a, _ = one_step(copy.deepcopy(model), tokenizer, tmp_path / "a", noise_multiplier=0.0,
                                 per_sample_max_grad_norm=clip)
    noisy, batch_b, trainer = one_step(model, tokenizer, tmp_path / "b", noise_multiplier=sigma,
                                       per_sample_max_grad_norm=clip)
    assert batch_a == batch_b  # the same secret seed, the same Poisson batch: the difference is the noise
    noise = torch.cat([(noisy[n] - clean[n]).flatten() for n in clean]).double()
    expected = sigma * clip / (PER_DEVICE * ACCUMULATION)
    assert noise.numel() > 15_000  # relative standard error of the std < 0.6 %: a 3 % band is > 5 of them
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert abs(noise.mean().item()) < 0.03 * expected
    plan = trainer.ledger.plan
    assert (plan.dataset_size, plan.phases[0].sample_rate, trainer.ledger.steps_done) == (12, 0.5, 1)
    truth = dp_accounting_epsilon(sigma, 0.5, 1, plan.target_delta, plan.neighboring)
    assert truth <= trainer.epsilon() <= truth * 1.002


def test_lora_reference_is_the_base_with_the_adapter_disabled(tokenizer, tmp_path):
    """A fresh LoRA adapter initialised non-zero (so the initial policy differs from the base): the σ = 0 update is
    the brute force whose reference is the base model alone; only the adapter trains; TRL's "ref" adapter copy is
    gone (the reference is the adapter-disabled base)."""
    from peft import LoraConfig

    # a strong adapter (α/r = 32) and no clipping (C = 1e3): a pair's factor σ(-β·margin), which the reference sets,
    # is not normalised away by clipping
    config = LoraConfig(r=2, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    base64 = copy.deepcopy(model).double().eval()
    got, batch, trainer = one_step(model, tokenizer, tmp_path, noise_multiplier=0.0, per_sample_max_grad_norm=1e3,
                                   trainer_kw={"peft_config": config})
    assert got and all("lora_" in n and ".default." in n for n in got)
    from peft import get_peft_model

    torch.manual_seed(0)
    policy64 = get_peft_model(copy.deepcopy(base64), config).double()
    trained_start = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    with torch.no_grad():  # the adapter as it was before the step: trained value + lr × update
        for n, p in policy64.named_parameters():
            if n in trained_start:
                p.copy_(trained_start[n].double() + 0.1 * got[n].double())
    grads = pair_gradients(policy64, base64, trainer.train_dataset, batch)
    want = {n: g / (PER_DEVICE * ACCUMULATION) for n, g in clipped_sum(grads, 1e3).items()}
    assert relative_error(got, want) < 1e-4
    assert list(trainer.model.peft_config) == ["default"]


def test_precomputed_reference_stays_in_memory_and_gives_the_same_update(tokenizer, tmp_path):
    """precompute_ref_log_probs: TRL would write the pairs' reference log-probabilities to a cache file beside the
    dataset's (here a dataset saved on disk); DPDPOTrainer keeps them in memory, and the update is unchanged."""
    from datasets import load_from_disk

    pairs().save_to_disk(str(tmp_path / "data"))
    data = load_from_disk(str(tmp_path / "data"))
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    want, batch_a, _ = one_step(copy.deepcopy(model), tokenizer, tmp_path / "a", data=data, noise_multiplier=0.0,
                                per_sample_max_grad_norm=0.1)
    got, batch_b, trainer = one_step(model, tokenizer, tmp_path / "b", data=data, noise_multiplier=0.0,
                                     per_sample_max_grad_norm=0.1, precompute_ref_log_probs=True)
    assert batch_a == batch_b and relative_error(got, want) < 1e-5
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.train_dataset.column_names)
    written = [Dataset.from_file(str(f)).column_names for f in (tmp_path / "data").rglob("*.arrow")]
    written += [Dataset.from_file(f["filename"]).column_names for f in trainer.train_dataset.cache_files]
    assert not any("ref_chosen_logps" in columns for columns in written)


def test_a_checkpoint_resumes_exactly_with_the_same_reference(tokenizer, tmp_path):
    """2 noisy steps with a checkpoint at each; resuming from checkpoint-1 (a fresh trainer, given the initial model,
    whose frozen copy is the reference again) gives the uninterrupted run's weights and ledger; the checkpoint's
    card is the DP card with the pair as the example."""
    def trainer():
        args = dpo_args(tmp_path, noise_multiplier=1.0, per_sample_max_grad_norm=1.0, learning_rate=1e-2,
                        max_steps=2, save_strategy="steps", save_steps=1)
        return DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer), seed=1), args=args, train_dataset=pairs(),
                            processing_class=tokenizer)

    full = trainer()
    full.train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert resumed.ledger.steps_done == 2 and resumed.epsilon() == pytest.approx(full.epsilon())
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=n)
    card = (tmp_path / "run" / "checkpoint-2" / "README.md").read_text()
    assert "| one training example | one preference pair" in card


@pytest.mark.parametrize("options", [{"loss_type": "aot"}, {"loss_type": ["sigmoid", "sft"]},
                                     {"activation_offloading": True}])
def test_losses_that_couple_pairs_are_refused_before_any_work(options, tmp_path):
    from hf_dp_repr.errors import DPConfigError

    with pytest.raises(DPConfigError, match="DPDPOConfig: (loss_type|activation_offloading)"):
        dpo_args(tmp_path, noise_multiplier=1.0, **options)
    assert not (tmp_path / "run").exists()


class LogsSeen(TrainerCallback):
    """What a tracker would receive (`on_log`)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_training_logs_carry_epsilon_and_no_dpo_metrics_of_private_pairs(tokenizer, tmp_path):
    """TRL's rewards/logps/logits/entropy/accuracy of the training pairs are computed outside DP-SGD: neither the
    logs a tracker receives nor log_history hold them; the loss and epsilon are logged."""
    seen = LogsSeen()
    _, _, trainer = one_step(tiny_llama(vocab_size=len(tokenizer), seed=0), tokenizer, tmp_path, noise_multiplier=1.0,
                             per_sample_max_grad_norm=1.0, logging_steps=1, trainer_kw={"callbacks": [seen]})
    for logs in (trainer.state.log_history, seen.logs):
        assert any("loss" in log and "epsilon" in log for log in logs), logs
        leaked = [k for log in logs for k in log
                  if k.split("/")[0] in ("rewards", "logps", "logits") or k in ("entropy", "mean_token_accuracy")]
        assert not leaked, leaked


def test_sync_ref_model_is_refused_on_a_sharded_run_before_any_work(tokenizer, tmp_path):
    from hf_dp_repr.errors import UnsupportedError

    args = dpo_args(tmp_path, noise_multiplier=1.0, sync_ref_model=True)
    args.fsdp, args.fsdp_config = True, {"fsdp_version": 2}  # (built in one process, the arguments refuse fsdp)
    with pytest.raises(UnsupportedError, match="sync_ref_model=True .* Fix: sync_ref_model=False"):
        DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer)), args=args, train_dataset=pairs(),
                     processing_class=tokenizer)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["_compute_loss", "_precompute_ref_logps", "precompute_ref_logps", "ref_model"])
def test_the_private_trl_members_it_relies_on_are_still_there(name):
    import inspect

    from trl import DPOTrainer

    from hf_dp_repr.trl.dpo import TRL_PRIVATE

    params, call, caller = TRL_PRIVATE[name]
    if params:
        assert tuple(inspect.signature(getattr(DPOTrainer, name)).parameters) == params
    assert call in inspect.getsource(getattr(DPOTrainer, caller))


@pytest.mark.slow
def test_the_dpo_recipe_runs_after_the_sft_recipe_on_the_same_users(tmp_path):
    """recipes/dp_sft.py, then recipes/dp_dpo.py from its output: pairs of the same users (one user per unit), the
    SFT adapter merged into the reference, ε of the run and composed with the SFT run's, the card, a saved answer."""
    import json

    from hf_dp_repr.scripts.dpo import conversation_pairs
    from hf_dp_repr.scripts.dpo import main as dpo_main
    from hf_dp_repr.scripts.sft import main as sft_main
    from hf_dp_repr.trl.chat_data import stdlib_conversations

    root = Path(__file__).parents[1] / "recipes" / "configs"
    common = ["--max_steps", "1", "--max_conversations", "120", "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "1", "--disable_tqdm", "true"]
    sft = sft_main(["--config", str(root / "dp_sft_tiny_llama.yaml"), "--output_dir", str(tmp_path / "sft"), *common])
    dpo = dpo_main(["--config", str(root / "dp_dpo_tiny_llama.yaml"), "--sft_model", str(tmp_path / "sft"),
                    "--output_dir", str(tmp_path / "dpo"), *common])
    assert sft["epsilon"] <= 8.0 and dpo["epsilon"] <= 8.0
    assert max(sft["epsilon"], dpo["epsilon"]) < dpo["epsilon_sft_then_dpo"] <= sft["epsilon"] + dpo["epsilon"]
    ledger = json.loads((tmp_path / "dpo" / "privacy_ledger.json").read_text())
    sft_ledger = json.loads((tmp_path / "sft" / "privacy_ledger.json").read_text())
    assert ledger["privacy_unit"] == "user_id" and ledger["dataset_size"] == sft_ledger["dataset_size"]
    card = (tmp_path / "dpo" / "README.md").read_text()
    assert "| one training example | one preference pair" in card and "rejected completion's tokens" in card
    assert {"adapter_model.safetensors", "base_model", "chat_template.jinja"} <= {p.name for p in (tmp_path / "dpo")
                                                                                  .iterdir()}
    chats = stdlib_conversations(max_conversations=12, max_per_user=15)
    pairs_ = conversation_pairs(chats)
    assert len(pairs_) == len(chats) and set(pairs_["user_id"]) == set(chats["user_id"])
    for prompt, rejected, user in zip(pairs_["prompt"], pairs_["rejected"], pairs_["user_id"]):
        answers = {c["messages"][-1]["content"] for c in chats if c["user_id"] == user}
        assert rejected[0]["content"] in answers | {"I do not know."}  # never another user's text


# ---- two processes (gloo), DDP and FSDP2, ONE launch: this file is also the worker ---------------------------------
FSDP = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
# σ = 0, q = 1 (6 pairs per process, L = 12), C far below every pair's gradient norm: the update is Σ C·g/|g| / L
EXACT = dict(noise_multiplier=0.0, per_sample_max_grad_norm=1e-3, learning_rate=1.0, per_device_train_batch_size=6,
             gradient_accumulation_steps=1)
# q = 1/3, one pair per micro-batch expected: some micro-batches are empty (TRL's metric gathers, and a sharded
# reference's forward, must not hang)
SPARSE = dict(noise_multiplier=1.0, per_sample_max_grad_norm=1.0, max_steps=4, per_device_train_batch_size=1,
              gradient_accumulation_steps=2)
# a fresh adapter initialised non-zero (so the initial policy is not the base), no clipping: the reference matters
LORA = dict(r=2, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
# run → (DPDPOConfig fields, the reference: "copy" (none given: a frozen copy, or with precompute the policy before
# training), "given" (ref_model=, the initial weights), "lora" (a fresh adapter: the base, the adapter disabled))
RUNS = {
    "ddp": (EXACT, "copy"),
    "fsdp_copy": ({**EXACT, **FSDP}, "copy"),
    "fsdp_users_precomputed": ({**EXACT, **FSDP, "privacy_unit": "user_id", "per_device_train_batch_size": 2,
                                "precompute_ref_log_probs": True}, "copy"),
    "fsdp_lora": ({**EXACT, **FSDP, "per_sample_max_grad_norm": 1e3}, "lora"),
    "ddp_sparse": (SPARSE, "copy"),
    # sharded, sparse and noisy: σ = 4 (noise std σC/L = 1 per coordinate per step, the clipped sums ~1e-3)
    "fsdp_noisy": ({**SPARSE, **FSDP, "noise_multiplier": 4.0, "learning_rate": 1e-4}, "given"),
}


USERS = 4  # fsdp_users_precomputed: pair i is user i % 4's (3 pairs each); q = 1 over users


def user_pairs():
    return pairs().add_column("user_id", [i % USERS for i in range(12)])


def full_weights(model) -> dict:
    """Every parameter whole (a collective for a sharded model: every process calls it)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def worker(out: str) -> None:
    """Each run of RUNS on every process; rank 0 saves (before − after) / lr and what the test reads."""
    from hf_dp_repr.privacy.sharding import is_sharded

    tokenizer = char_tokenizer()
    for name, (fields, reference) in RUNS.items():
        kw = {}
        if reference == "given":
            kw["ref_model"] = tiny_llama(vocab_size=len(tokenizer), seed=0)
        if reference == "lora":
            from peft import LoraConfig

            kw["peft_config"] = LoraConfig(**LORA)
        args = dpo_args(Path(out) / name, **fields)
        data = user_pairs() if "privacy_unit" in fields else pairs()
        trainer = DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer), seed=0), args=args, train_dataset=data,
                               processing_class=tokenizer, **kw)
        before = full_weights(trainer.model)
        trainer.train()
        after = full_weights(trainer.model)
        if trainer.is_world_process_zero():
            led, ref = trainer.ledger, trainer.ref_model
            torch.save({"before": before, "delta": {n: (before[n] - after[n]) / args.learning_rate for n in after},
                        "trained": [n for n, p in trainer.model.named_parameters() if p.requires_grad],
                        "world_size": led.plan.world_size, "sample_rate": led.plan.phases[0].sample_rate,
                        "expected_batch": led.expected_batch_size, "steps": led.steps_done,
                        "unit": led.plan.privacy_unit, "dataset_size": led.plan.dataset_size,
                        "epsilon": trainer.epsilon(), "delta_privacy": led.plan.target_delta,
                        "neighboring": led.plan.neighboring, "sharded": trainer.sharded,
                        "reference": None if ref is None else ("sharded" if is_sharded(ref) else "whole"),
                        "adapters": list(getattr(trainer.model, "peft_config", {})),
                        "columns": trainer.train_dataset.column_names}, Path(out) / f"{name}.pt")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    from utils import launch_two_workers

    out = tmp_path_factory.mktemp("dpo_two")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{tests.parent}:{tests}"}
    launch_two_workers(Path(__file__).name, out, env, timeout=500)
    return {name: torch.load(out / f"{name}.pt") for name in RUNS}


@pytest.fixture(scope="module")
def every_pair_gradient(tmp_path_factory):
    """Every pair's DPO-loss gradient alone, in float64 (the policy and the reference: the initial weights)."""
    tokenizer = char_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    policy64, reference64 = copy.deepcopy(model).double(), copy.deepcopy(model).double().eval()
    probe = tokenized(model, tokenizer, tmp_path_factory.mktemp("dpo_want"))
    return pair_gradients(policy64, reference64, probe, range(len(probe)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp_copy", "fsdp_users_precomputed"])
def test_two_processes_clip_each_pair_once(name, two_processes, every_pair_gradient):
    """σ = 0, q = 1, C below every pair's gradient norm: on 2 processes, DDP or sharded (FSDP2) with the reference a
    sharded frozen copy (a given ref_model: fsdp_noisy), L × the update is the brute force's Σ C·g/|g|: each pair
    moves it by exactly C (its two rows clipped apart would not). Sharded with users as units and the reference
    precomputed from the sharded policy, each user's pairs are summed and clipped together: Σ_u C·g_u/|g_u|."""
    got = two_processes[name]
    assert (got["world_size"], got["sample_rate"], got["steps"], got["sharded"]) == (2, 1.0, 1, "fsdp" in name)
    assert got["reference"] == {"ddp": "whole", "fsdp_copy": "sharded"}.get(name)
    grads = every_pair_gradient
    if name == "fsdp_users_precomputed":
        assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(got["columns"])
        assert (got["unit"], got["dataset_size"], got["expected_batch"]) == ("user_id", USERS, USERS)
        grads = [{n: sum(grads[i][n] for i in range(u, len(grads), USERS)) for n in grads[0]} for u in range(USERS)]
    update = {n: d * got["expected_batch"] for n, d in got["delta"].items()}
    assert relative_error(update, clipped_sum(grads, EXACT["per_sample_max_grad_norm"])) < 1e-3


@pytest.mark.slow
def test_two_processes_sharded_lora_reference_is_the_adapter_disabled_base(two_processes, tokenizer, tmp_path):
    """FSDP2 with a fresh non-zero LoRA adapter: no "ref" copy of the adapter is made (TRL's copy onto a sharded model
    fails); the σ = 0 update is the brute force whose reference is the base alone, the policy the adapter as it was."""
    from peft import LoraConfig, get_peft_model

    got = two_processes["fsdp_lora"]
    assert got["sharded"] and got["reference"] is None and got["adapters"] == ["default"]
    assert got["trained"] and all("lora_" in n for n in got["trained"])
    base = tiny_llama(vocab_size=len(tokenizer), seed=0)
    base64 = copy.deepcopy(base).double().eval()
    policy64 = get_peft_model(copy.deepcopy(base64), LoraConfig(**LORA)).double()
    with torch.no_grad():
        for n, p in policy64.named_parameters():
            p.copy_(got["before"][n].double())
    dataset = tokenized(base, tokenizer, tmp_path)
    grads = pair_gradients(policy64, base64, dataset, range(len(dataset)))
    want = clipped_sum(grads, 1e3)
    update = {n: got["delta"][n] * got["expected_batch"] for n in want}
    assert relative_error(update, want) < 1e-3


@pytest.mark.slow
def test_two_processes_sharded_noise_once_per_step_and_epsilon_is_dp_accountings(two_processes):
    """σ = 4, C = 1, L = 4 of 12 pairs over 2 sharded processes, 4 steps: the noise has std σC/L per coordinate and
    step (added once per logical batch, each coordinate by the one process that holds it: √2 × if each process
    noised all), and ε is dp_accounting's for q = 1/3."""
    got = two_processes["fsdp_noisy"]
    sigma, L, steps = 4.0, got["expected_batch"], got["steps"]
    deltas = torch.cat([d.flatten() for d in got["delta"].values()]).double()
    assert (L, steps) == (4, 4) and deltas.numel() > 15_000
    assert deltas.std().item() / (sigma * 1.0 / L * steps ** 0.5) == pytest.approx(1.0, abs=0.03)
    truth = dp_accounting_epsilon(sigma, got["sample_rate"], steps, got["delta_privacy"], got["neighboring"])
    assert truth <= got["epsilon"] <= truth * 1.002


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_sparse", "fsdp_noisy"])
def test_two_processes_run_steps_with_empty_micro_batches(name, two_processes):
    got = two_processes[name]
    assert (got["steps"], got["world_size"]) == (4, 2) and got["sample_rate"] == pytest.approx(4 / 12)
    assert got["reference"] == ("sharded" if name == "fsdp_noisy" else "whole")


if __name__ == "__main__":
    worker(sys.argv[1])


# ---- what reaches logs and files: TRL's eval metrics and counters (issue 38) -----------------------------------------
def test_eval_metrics_of_training_pairs_and_trl_token_counts_stay_out_of_logs_files_and_pushes(tokenizer, tmp_path):
    """With eval_dataset = the training pairs, TRL's own eval metrics (`eval_rewards/*`, `eval_logps/*`, ...) are
    statistics of private pairs: named `train_eval_*` like the Trainer's eval loss, so kept out of the metrics files,
    the card and pushes. TRL's `eval_num_tokens` is its running count of TRAINING tokens (it moved by 2 × a removed
    pair's tokens): dropped from every log, log_history, trainer_state.json and the files (seen failing without: both
    reached all_results.json and the card, and the push check passed them)."""
    import json

    from hf_dp_repr.hub.push import check_pushable

    seen = LogsSeen()
    data = pairs()
    trainer = DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer), seed=0), train_dataset=data,
                           eval_dataset=data, processing_class=tokenizer, callbacks=[seen],
                           args=dpo_args(tmp_path, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                         eval_strategy="steps", eval_steps=1, logging_steps=1))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    trainer.save_model()
    trainer.save_state()
    out = Path(trainer.args.output_dir)
    assert any(k.startswith("train_eval_rewards/") for k in metrics) and "train_eval_loss" in metrics, metrics
    saved = {k: v for name in ("all_results.json", "eval_results.json") for k, v in
             json.loads((out / name).read_text()).items()}
    state = json.loads((out / "trainer_state.json").read_text())["log_history"]
    card = (out / "README.md").read_text()
    for keys in (metrics, saved, *trainer.state.log_history, *state, *seen.logs):
        leaked = [k for k in keys if "num_tokens" in k or k.startswith("eval_")]
        assert not leaked, leaked
    assert "num_tokens" not in card and "rewards/" not in card and "logps/" not in card
    check_pushable(out)  # nothing private written
    (out / "eval_results.json").write_text(json.dumps({"eval_num_tokens": 154, "eval_accuracy": 0.5}))
    with pytest.raises(ValueError, match="eval_num_tokens"):
        check_pushable(out)


def test_pairs_dropped_by_truncation_are_refused_not_a_smaller_n(tokenizer, tmp_path):
    """TRL drops a pair whose prompt alone fills max_length: n (so q, σ and the card) would then depend on a private
    record's content (12 vs 11 pairs, seen so without the check). Refused before training, naming max_length."""
    from hf_dp_repr.errors import DPConfigError

    data = pairs().to_dict()
    data["prompt"][5] = "a very long prompt that fills the whole max length "
    with pytest.raises(DPConfigError, match=r"dropped 1 of its 12 rows .*max_length=16"):
        DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer), seed=0), train_dataset=Dataset.from_dict(data),
                     processing_class=tokenizer, args=dpo_args(tmp_path, noise_multiplier=1.0, max_length=16))
    assert not (tmp_path / "run").exists()
