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
    capture = CaptureUpdate()
    trainer = DPDPOTrainer(model=model, args=dpo_args(tmp_path, **kw), train_dataset=data or pairs(),
                           processing_class=tokenizer, callbacks=[capture], **(trainer_kw or {}))
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


def test_sharded_dpo_is_refused_before_any_work(tokenizer, tmp_path):
    """TRL copies the LoRA adapter into its reference adapter after the model is sharded (measured: a copy_ between a
    tensor and a DTensor fails); refused, naming the fix."""
    from hf_dp_repr.errors import UnsupportedError

    args = dpo_args(tmp_path, noise_multiplier=1.0)
    args.fsdp, args.fsdp_config = True, {"fsdp_version": 2}  # (built in one process, the arguments refuse fsdp)
    with pytest.raises(UnsupportedError, match="sharded DPO .* run without --fsdp"):
        DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer)), args=args, train_dataset=pairs(),
                     processing_class=tokenizer)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["_compute_loss", "_precompute_ref_logps", "precompute_ref_logps"])
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


# ---- two processes (accelerate launch, gloo): this file is also the worker --------------------------------------
def ddp_worker(out: str) -> None:
    """Rank 0 saves L × the σ = 0 update of one step with q = 1 (6 pairs per process), then runs 4 steps at q = 1/3
    (one pair per micro-batch expected: some micro-batches are empty; TRL's metric gathers must not hang)."""
    tokenizer = char_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = dpo_args(Path(out).parent, noise_multiplier=0.0, per_sample_max_grad_norm=1e-3, learning_rate=1.0,
                    per_device_train_batch_size=6, gradient_accumulation_steps=1)
    trainer = DPDPOTrainer(model=model, args=args, train_dataset=pairs(), processing_class=tokenizer)
    trainer.train()
    sparse = dpo_args(Path(out).parent / "sparse", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, max_steps=4,
                      per_device_train_batch_size=1, gradient_accumulation_steps=2)
    again = DPDPOTrainer(model=tiny_llama(vocab_size=len(tokenizer), seed=0), args=sparse, train_dataset=pairs(),
                         processing_class=tokenizer)
    again.train()
    if trainer.is_world_process_zero():
        led = trainer.ledger
        update = {n: (before[n] - p.detach()) * led.expected_batch_size for n, p in trainer.model.named_parameters()}
        torch.save({"update": update, "world_size": led.plan.world_size, "sample_rate": led.plan.phases[0].sample_rate,
                    "sparse_steps": again.ledger.steps_done, "sparse_rate": again.ledger.plan.phases[0].sample_rate},
                   out)


@pytest.mark.slow
def test_two_processes_clip_each_pair_once(tokenizer, tmp_path):
    import subprocess

    from utils import ACCEL_CONFIG, free_port

    out = tmp_path / "update.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL_CONFIG),
           "--main_process_port", str(free_port()), __file__, str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    saved = torch.load(out)
    assert (saved["world_size"], saved["sample_rate"], saved["sparse_steps"]) == (2, 1.0, 4)
    assert saved["sparse_rate"] == pytest.approx(4 / 12)
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    policy64, reference64 = copy.deepcopy(model).double(), copy.deepcopy(model).double().eval()
    probe = tokenized(model, tokenizer, tmp_path)
    want = clipped_sum(pair_gradients(policy64, reference64, probe, range(len(probe))), 1e-3)
    assert relative_error(saved["update"], want) < 1e-3


if __name__ == "__main__":
    ddp_worker(sys.argv[1])
