"""DP SFT with TRL (`hf_dp_repr.trl.DPSFTTrainer`, issue 30): one conversation (or one user) is one example, the loss on
the assistant's tokens only, clipped per example by either engine, noise σC/L once per step, ε from the accountant.

A tiny Llama-style chat model (from a config), a tokenizer trained here with a chat template whose assistant turns sit
in `{% generation %}` blocks, and conversations of different lengths built from Python's docstrings. The σ = 0
update is compared with a float64 brute force that takes one conversation at a time, builds its assistant-token labels
itself from the special tokens, computes the model's own HF loss and clips that gradient."""

import copy
import json

import pytest
import torch

from hf_dp_repr.errors import ArgumentTypeError, DPConfigError, UnsupportedError
from hf_dp_repr.tiny import tiny_llama
from hf_dp_repr.training.hf_compat import TRL_PRIVATE
from hf_dp_repr.training.trainer import DPTrainer
from hf_dp_repr.trl import DPSFTConfig, DPSFTTrainer, dp_trainer_class
from hf_dp_repr.trl.chat_data import ASSISTANT, END, chat_tokenizer, stdlib_conversations
from utils import CaptureUpdate

PUBLIC = ["What does this function do? It returns the value of the given key.",
          "Tell me more about the module and its classes, methods and arguments."] * 20
BATCH, ACCUMULATION = 4, 3  # 12 conversations, q = 1: every conversation in the step


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer(PUBLIC, vocab_size=300)


@pytest.fixture(scope="module")
def chats():
    return stdlib_conversations(max_conversations=12, max_per_user=3, max_chars=120)


def sft_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUMULATION, max_steps=1, learning_rate=1.0, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, noise_multiplier=0.0,
                assistant_only_loss=True, max_length=256, report_to="none", save_strategy="no", disable_tqdm=True,
                seed=0, noise_seed=5, target_delta=1e-3)
    return DPSFTConfig(**{**base, **kw})


def lora_llama(vocab):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(tiny_llama(vocab_size=vocab), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                   lora_dropout=0.0, init_lora_weights=False))


def assistant_labels(ids: torch.Tensor, tok) -> torch.Tensor:
    """-100 everywhere but the assistant's turns: the tokens after an <|assistant|> token up to its <|end|>."""
    start, end = tok.convert_tokens_to_ids(ASSISTANT), tok.convert_tokens_to_ids(END)
    labels, inside = torch.full_like(ids, -100), False
    for t, token in enumerate(ids.tolist()):
        if inside:
            labels[t] = token
            inside = token != end
        elif token == start:
            inside = True
    return labels


def per_example_gradients(model, trainer, rows, tok, units=None) -> tuple[list[str], dict]:
    """{example (or unit): its float64 gradient}, each example alone through the model's own HF loss (a unit: the sum
    of its rows' gradients)."""
    ref = copy.deepcopy(model).double()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    grads = {}
    for i in rows:
        row = trainer.train_dataset[i]
        ids = torch.tensor(row["input_ids"])[None]
        labels = assistant_labels(ids[0], tok)[None]
        assert labels.tolist() == [row["labels"]], "TRL's labels are not the assistant's tokens"
        g = torch.autograd.grad(ref(input_ids=ids, labels=labels).loss, [p for _, p in named])
        key = i if units is None else units[i]
        grads[key] = [a + b for a, b in zip(grads[key], g)] if key in grads else list(g)
    return [n for n, _ in named], grads


def norm(g) -> float:
    return torch.sqrt(sum((x ** 2).sum() for x in g)).item()


def clipped_mean(names, grads, clip, expected_batch) -> dict:
    total = {n: 0.0 for n in names}
    for g in grads.values():
        for n, x in zip(names, g):
            total[n] = total[n] + x * min(1.0, clip / norm(g))
    return {n: t / expected_batch for n, t in total.items()}


@pytest.mark.parametrize("kind, engine, unit", [("full", "ghost", "row"), ("full", "hooks", "row"),
                                                ("lora", "auto", "row"), ("full", "hooks", "user_id")])
def test_sigma0_update_equals_the_float64_brute_force_of_clipped_conversations(kind, engine, unit, chats, tok,
                                                                              tmp_path):
    """q = 1 (every conversation, or every user, in the step), C the median of their gradient norms: half are
    clipped, half are not, so both the clipping and each example's own loss (its mean over its assistant tokens,
    not the batch's) are tested."""
    model = lora_llama(len(tok)) if kind == "lora" else tiny_llama(vocab_size=len(tok), seed=1)
    start = copy.deepcopy(model)
    per_unit = {} if unit == "row" else {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}  # 4 users
    capture = CaptureUpdate()
    trainer = DPSFTTrainer(model=model, args=sft_args(tmp_path, clipping_engine=engine, privacy_unit=unit, **per_unit),
                           train_dataset=chats, processing_class=tok, callbacks=[capture])
    units = list(trainer.train_dataset["user_id"]) if unit != "row" else None
    names, grads = per_example_gradients(start, trainer, range(len(trainer.train_dataset)), tok, units)
    norms = sorted(norm(g) for g in grads.values())
    clip = (norms[len(norms) // 2 - 1] + norms[len(norms) // 2]) / 2
    trainer.args.per_sample_max_grad_norm = clip
    trainer.train()
    sampler = trainer.engine.sampler
    sampler.set_epoch(0)
    batch = [i for chunk in list(sampler)[:trainer.args.gradient_accumulation_steps] for i in chunk]
    assert sorted(batch) == list(range(12))  # every conversation, of many lengths (padded differently)
    assert len({len(trainer.train_dataset[i]["input_ids"]) for i in batch}) > 4
    assert trainer.engine.clipping_engine == ("hooks" if unit != "row" else "ghost" if engine == "auto" else engine)
    want = clipped_mean(names, grads, clip, trainer.ledger.plan.phases[0].expected_batch_size)
    got = capture.grads
    if kind == "lora":
        assert all("lora_" in n for n in got) and len(got) == 8
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n].double(), want[n], rtol=1e-4, atol=1e-5 * want[n].abs().max().item(), msg=n)


# ---- one noisy run: noise, ε, logs, card -----------------------------------------------------------------------
SIGMA = 300.0


@pytest.fixture(scope="module")
def noisy(chats, tok, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("noisy")
    model = tiny_llama(vocab_size=len(tok), seed=1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPSFTTrainer(model=model, args=sft_args(tmp, noise_multiplier=SIGMA, per_sample_max_grad_norm=1.0,
                                                      learning_rate=1e-3, max_steps=2, logging_steps=1),
                           train_dataset=chats, processing_class=tok,
                           model_card_info={"private_data": "conversations about the standard library"})
    trainer.train()
    trainer.save_model()
    return trainer, start, tmp / "run"


def test_noise_std_is_sigma_c_over_l_per_coordinate(noisy):
    trainer, start, _ = noisy
    deltas = torch.cat([(p.detach() - start[n]).flatten() for n, p in trainer.model.named_parameters()])
    # two steps: Σ of two independent noises, each lr·σ·C/L per coordinate (the clipped sum ≤ L·C is negligible)
    assert float(deltas.std()) / 1e-3 == pytest.approx(SIGMA * 1.0 / (BATCH * ACCUMULATION) * 2 ** 0.5, rel=0.03)


def test_epsilon_is_dp_accountings_for_the_plan(noisy):
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    trainer, _, _ = noisy
    (phase,) = trainer.ledger.plan.phases
    assert (phase.noise_multiplier, phase.sample_rate, trainer.ledger.steps_done) == (SIGMA, 1.0, 2)
    acc = PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(SIGMA)), 2)
    want = acc.get_epsilon(1e-3)
    assert trainer.epsilon() == pytest.approx(want, rel=0.02) and trainer.epsilon() >= want * 0.999


def test_training_logs_carry_epsilon_and_no_sft_metrics_of_private_batches(noisy):
    trainer, _, _ = noisy
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 2 and all("epsilon" in log for log in train_logs)
    for log in trainer.state.log_history:
        assert not {"mean_token_accuracy", "entropy", "num_tokens", "grad_norm"} & set(log), log


def test_the_card_says_a_conversation_is_an_example_and_the_loss_saw_the_assistants_tokens(noisy):
    _, _, out = noisy
    card = (out / "README.md").read_text()
    assert "| one training example | one conversation (`messages`, rendered with the chat template)" in card
    assert "| tokens the loss saw | the assistant's tokens only" in card
    assert json.loads((out / "privacy_ledger.json").read_text())["steps_done"] == 2


# ---- data: truncation, prompt/completion -----------------------------------------------------------------------
def test_truncation_keeps_one_row_per_conversation(chats, tok, tmp_path):
    """max_length cuts a conversation's tail; it stays one row (one example), never split into several."""
    trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=sft_args(tmp_path, max_length=40),
                           train_dataset=chats, processing_class=tok)
    rows = trainer.train_dataset
    assert len(rows) == len(chats) and [r["messages"] for r in rows] == list(chats["messages"])
    assert all(len(r["input_ids"]) <= 40 for r in rows) and sum(len(r["input_ids"]) == 40 for r in rows) >= 10
    assert all(any(x != -100 for x in r["labels"]) for r in rows)  # each keeps the start of an answer


def test_prompt_completion_counts_only_the_completion(tok, tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": f"Question {i}: what is it?", "completion": " It is " + "x" * (i + 1)}
                              for i in range(8)])
    trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=sft_args(
        tmp_path, assistant_only_loss=False, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        save_strategy="no"), train_dataset=data, processing_class=tok)
    prompt_len = len(tok("Question 0: what is it?")["input_ids"])
    row = trainer.train_dataset[0]
    assert row["labels"][:prompt_len - 1] == [-100] * (prompt_len - 1) and row["labels"][-1] != -100
    trainer.train()
    assert trainer.ledger.steps_done == 1
    assert trainer.model_card_info.loss_tokens == "the completion's tokens only (`completion_only_loss`)"
    assert trainer.model_card_info.training_example == "one prompt/completion pair"


# ---- refusals, before any work --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [({"packing": True}, "packing=False"),
                                       ({"padding_free": True}, "padding_free=False and packing=False"),
                                       ({"activation_offloading": True}, "activation_offloading=False")])
def test_options_that_merge_examples_are_refused_in_the_config_and_the_trainer(kw, match, chats, tok, tmp_path):
    with pytest.raises(DPConfigError, match=match):
        sft_args(tmp_path, **kw)
    args = sft_args(tmp_path)
    for k, v in kw.items():
        setattr(args, k, v)  # set after the config was built
    with pytest.raises(DPConfigError, match=match):
        DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=args, train_dataset=chats, processing_class=tok)
    assert not (tmp_path / "run").exists()


def test_cpu_defaults_and_trl_defaults(tmp_path):
    args = DPSFTConfig(output_dir=str(tmp_path / "x"), target_epsilon=8.0, report_to="none")
    assert args.bf16 is False and not args.gradient_checkpointing  # TRL's GPU defaults off on a CPU
    assert (args.learning_rate, args.logging_steps, args.max_length, args.max_grad_norm) == (2e-5, 10, 1024, 0.0)


def test_other_trl_trainers_and_foreign_arguments_are_refused(chats, tok, tmp_path):
    import trl
    from transformers import Trainer

    from hf_dp_repr import DPTrainingArguments

    for name, match in (("GRPOTrainer", "generates|completions"), ("KTOTrainer", "KL estimate"),
                        ("RLOOTrainer", "completions"), ("RewardTrainer", "not tested")):
        with pytest.raises(UnsupportedError, match=match):
            dp_trainer_class(getattr(trl, name))

    class Custom(trl.SFTTrainer):  # a user's subclass of a supported trainer is fine
        pass

    assert issubclass(dp_trainer_class(Custom), (DPTrainer, Custom))

    class BatchLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    with pytest.raises(UnsupportedError, match="per_example_loss=fn"):
        dp_trainer_class(BatchLoss)
    plain = DPTrainingArguments(output_dir=str(tmp_path / "run"), target_epsilon=8.0, report_to="none")
    with pytest.raises(ArgumentTypeError, match="must be a DPSFTConfig"):
        DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=plain, train_dataset=chats, processing_class=tok)


@pytest.mark.parametrize("owner, name, where, text, why", TRL_PRIVATE, ids=[f"{o}.{n}" for o, n, *_ in TRL_PRIVATE])
def test_trl_private_members_we_rely_on_are_still_used_as_we_rely_on(owner, name, where, text, why):
    import inspect

    import trl
    from trl.trainer import base_trainer

    cls = getattr(trl, owner, None) or getattr(base_trainer, owner)
    assert text in inspect.getsource(getattr(cls, where)), f"trl {trl.__version__}: {owner}.{where} no longer runs " \
        f"`{text}`; we rely on it: {why}"


@pytest.mark.slow  # three trainings with checkpoints (~50 s on a loaded 2-core machine)
def test_a_checkpoint_resumes_exactly_and_keeps_the_dp_card(chats, tok, tmp_path):
    """2 noisy steps with a checkpoint at each; resuming from checkpoint-1 gives the uninterrupted run's weights and
    ledger (noise and batches are drawn per step from the run's seed); TRL's checkpoint card does not replace the DP
    card or its model_card_info."""
    def trainer(out):
        args = sft_args(tmp_path, output_dir=str(tmp_path / out), noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                        learning_rate=1e-2, max_steps=2, save_strategy="steps", save_steps=1, optim="adamw_torch")
        return DPSFTTrainer(model=tiny_llama(vocab_size=len(tok), seed=1), args=args, train_dataset=chats,
                            processing_class=tok, model_card_info={"model_name": "my chat model"})

    full = trainer("full")
    full.train()
    resumed = trainer("full")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.ledger.steps_done == 2 and resumed.epsilon() == pytest.approx(full.epsilon())
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=n)
    card = (tmp_path / "full" / "checkpoint-2" / "README.md").read_text()
    assert "my chat model (DP-SGD" in card and "| one training example | one conversation" in card


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_each_examples_loss_is_sft_trainers_loss_on_that_example_alone(loss_type, chats, tok, tmp_path):
    """DPSFTTrainer's per-example losses of a padded batch equal SFTTrainer's own compute_loss (its fused LM head)
    run on each conversation alone, for nll and dft."""
    import trl

    trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok), seed=1), args=sft_args(tmp_path, loss_type=loss_type),
                           train_dataset=chats, processing_class=tok)
    rows = [{k: trainer.train_dataset[i][k] for k in ("input_ids", "labels")} for i in range(4)]
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    with torch.no_grad():
        ours = trainer.example_losses(trainer.model, dict(batch))
        alone = [trl.SFTTrainer.compute_loss(trainer, trainer.model, trainer._prepare_inputs(
            trainer.data_collator([row]))) for row in rows]
    torch.testing.assert_close(ours, torch.stack(alone), rtol=1e-4, atol=1e-5)


# ---- issue 38: TRL's eval metrics of training rows, rows dropped by truncation, token counts -----------------------
def test_sft_eval_metrics_of_training_rows_are_private_and_token_counts_are_refused(chats, tok, tmp_path):
    """eval_dataset = the training conversations: SFTTrainer's own eval metrics (entropy, token accuracy) are named
    `train_eval_*` like the eval loss, so never written to the metrics files (seen failing without: `eval_entropy`,
    `eval_mean_token_accuracy` in all_results.json); TRL's `eval_num_tokens` counter is logged nowhere;
    include_num_input_tokens_seen (a count of the private batches' tokens) is refused before any work."""
    trainer = DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=sft_args(tmp_path), train_dataset=chats,
                           eval_dataset=chats, processing_class=tok)
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    assert {"train_eval_entropy", "train_eval_mean_token_accuracy", "train_eval_loss"} <= set(metrics), metrics
    written = json.loads((tmp_path / "run" / "all_results.json").read_text())
    for keys in (metrics, written, *trainer.state.log_history):
        assert not [k for k in keys if k.startswith("eval_") or "num_tokens" in k], keys
    with pytest.raises(DPConfigError, match="include_num_input_tokens_seen=True is refused"):
        sft_args(tmp_path, include_num_input_tokens_seen=True)


def test_conversations_dropped_by_truncation_are_refused_not_a_smaller_n(chats, tok, tmp_path):
    """A conversation whose assistant turn starts past max_length keeps no loss token and TRL drops it: n would count
    12 or 11 records by their content (seen so without the check). Refused before training, naming max_length."""
    rows = chats.to_list()
    first_user = rows[3]["messages"][0]
    first_user["content"] = " ".join(["module"] * 80)
    data = type(chats).from_list(rows)
    with pytest.raises(DPConfigError, match=r"dropped 1 of its 12 rows .*max_length=64"):
        DPSFTTrainer(model=tiny_llama(vocab_size=len(tok)), args=sft_args(tmp_path, max_length=64), train_dataset=data,
                     processing_class=tok)
