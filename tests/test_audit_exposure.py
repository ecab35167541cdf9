"""Canary exposure (hf_dp_repr.audit.exposure): one tiny GPT-2 trained with and without DP on short stdlib paragraphs
plus a canary repeated 16 times (one unit: `document_id`) and a canary never inserted; the asserts share that run."""

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.audit.exposure import CANARY_NAMES, Canary, draw_canaries, exposure, fill, log_perplexities
from hf_dp_repr.audit.exposure_run import EXPOSURE_FILE, coverage, exposure_audit, save_model_exposures
from hf_dp_repr.data import load_stdlib_paragraphs
from hf_dp_repr.data.tokenizer import train_tokenizer
from hf_dp_repr.errors import ArgumentError
from hf_dp_repr.privacy.randomness import DPRandomness
from hf_dp_repr.tiny import tiny_gpt2

LOG2_R = math.log2(10 ** 4)
NEAR_RANDOM = 5.0  # bits: a never-seen secret exceeds it with probability 2^-5


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_stdlib_paragraphs()["test"]["text"], 512)  # held-out text: public here


def _model(tok):
    return tiny_gpt2(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def audit(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("exposure")
    canaries = draw_canaries(DPRandomness(noise_seed=0), repeats=(16,), length=4)
    args = DPTrainingArguments(output_dir=str(out / "dp"), target_epsilon=1.0, target_delta=1e-3,
                               per_device_train_batch_size=8, num_train_epochs=40, learning_rate=1e-2,
                               privacy_unit="document_id", noise_seed=0, report_to="none", save_strategy="no",
                               disable_tqdm=True)
    texts = load_stdlib_paragraphs()["train"]["text"][:16]
    report, dp, plain = exposure_audit(_model(tokenizer), tokenizer, texts, args, canaries, max_length=32)
    return dict(report=report, dp=dp, plain=plain, canaries=canaries, out=out)


@pytest.mark.slow
def test_a_canary_seen_16_times_without_dp_ranks_first(audit):
    seen, never = audit["report"]["canaries"]
    assert seen["repeats"] == 16 and never["repeats"] == 0
    assert seen["method"] == "exact" and seen["candidates"] == 10 ** 4
    assert seen["non_private_exposure"] == pytest.approx(LOG2_R)  # rank 1 of 10^4


@pytest.mark.slow
def test_dp_at_epsilon_1_keeps_exposure_near_random(audit):
    report = audit["report"]
    assert report["claimed_epsilon"] == pytest.approx(1.0, abs=0.01)
    seen, never = report["canaries"]
    assert seen["exposure"] < NEAR_RANDOM
    assert never["exposure"] < NEAR_RANDOM and never["non_private_exposure"] < NEAR_RANDOM
    assert re.match(r"one unit: \(ε = (1|0\.999),", seen["covered_by"])  # its 16 copies share one document_id


@pytest.mark.slow
def test_extrapolation_agrees_with_the_exact_rank(audit, tokenizer):
    seen, never = audit["canaries"]
    fitted = exposure(audit["plain"], tokenizer, seen, exact_limit=0, samples=2000)
    assert fitted["method"] == "extrapolated" and fitted["exposure"] > 10  # memorised: far in the fitted tail
    exact, fitted = (exposure(audit["plain"], tokenizer, never, exact_limit=e, samples=2000) for e in (10 ** 4, 0))
    assert abs(fitted["exposure"] - exact["exposure"]) < 1.5


@pytest.mark.slow
def test_the_card_reports_dp_exposures_and_no_secret(audit):
    dp, out = audit["dp"], audit["out"] / "dp"
    dp.save_model()
    save_model_exposures(audit["report"], str(out))
    card = (out / "README.md").read_text()
    assert "Canary exposure" in card and "not the guarantee" in card
    assert f"| 16 | 10000 | {audit['report']['canaries'][0]['exposure']:.2f} | exact |" in card
    written = " ".join(p.read_text(errors="ignore") for p in out.iterdir() if p.is_file())
    for canary in audit["canaries"]:
        assert fill(canary.secret).strip() not in written and "".join(canary.secret) not in written
    shown = json.loads((out / EXPOSURE_FILE).read_text())
    assert "non_private_exposure" not in json.dumps(shown)  # the control's numbers stay in the report


def test_log_perplexities_match_a_plain_forward(tokenizer):
    model, prefix = _model(tokenizer), "the secret code of maple is"
    fillings = [("4", "8", "1", "2"), ("0",), ("9", "9")]
    got = log_perplexities(model, tokenizer, prefix, fillings, batch_size=2)
    start = [tokenizer.bos_token_id] + tokenizer(prefix)["input_ids"]
    for value, f in zip(got, fillings):
        ids = torch.tensor([start + tokenizer(fill(f))["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert value == pytest.approx(float(-logp[len(start) - 1:].sum()) / math.log(2), rel=1e-4)


def test_exact_rank_counts_lower_candidates(tokenizer):
    model, canary = _model(tokenizer), Canary("maple", ("3", "1"), 1)
    everyone = log_perplexities(model, tokenizer, canary.prefix, list(itertools.product(canary.alphabet, repeat=2)))
    result = exposure(model, tokenizer, canary)
    assert result["rank"] == 1 + int(np.sum(everyone < everyone[31]))
    assert result["exposure"] == pytest.approx(math.log2(100) - math.log2(result["rank"]))


def test_canaries_come_from_the_secret_with_their_own_purpose():
    a, b = draw_canaries(DPRandomness()), draw_canaries(DPRandomness())
    assert [c.secret for c in a] != [c.secret for c in b]  # OS entropy: a fresh secret each run
    seeded = [c.secret for c in draw_canaries(DPRandomness(noise_seed=3))]
    assert seeded == [c.secret for c in draw_canaries(DPRandomness(noise_seed=3))]
    assert [c.repeats for c in a] == [1, 4, 16, 0] and [c.name for c in a] == list(CANARY_NAMES[:4])
    assert all("secret" not in c.public() and "".join(c.secret) not in json.dumps(c.public()) for c in a)
    with pytest.raises(ArgumentError, match="repeats"):
        draw_canaries(DPRandomness(), repeats=(0.5,))


def test_coverage_names_the_guarantee():
    assert coverage("document_id", 16, 1.0, 1e-5) == "one unit: (ε = 1, δ = 1e-05)"
    assert coverage("row", 4, 1.0, 1e-5).startswith("4 units (one per copy): group privacy only, (ε = 4,")
    assert coverage("row", 4, None, 1e-5) == "no DP guarantee (ε = ∞)"


@pytest.mark.slow
def test_cli_writes_report_plot_and_dp_model(tmp_path, capsys):
    from hf_dp_repr.cli import main

    out = tmp_path / "audit"
    main(["audit", "exposure", "--max-rows", "8", "--repeats", "4", "--secret-length", "2", "--max-length", "32",
          "--out", str(out), "--", "--target_epsilon", "2", "--target_delta", "1e-3", "--max_steps", "3",
          "--per_device_train_batch_size", "4", "--noise_seed", "0", "--disable_tqdm", "true"])
    report = json.loads((out / "privacy_audit_exposure.json").read_text())
    assert [c["repeats"] for c in report["canaries"]] == [4, 0] and report["privacy_unit"] == "document_id"
    assert all({"exposure", "non_private_exposure"} <= set(c) for c in report["canaries"])
    assert (out / "privacy_audit_exposure.png").stat().st_size > 0
    assert (out / "model" / "privacy_ledger.json").is_file() and "Canary exposure" in (out / "model" / "README.md"
                                                                                        ).read_text()
    assert "inserted" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--push_to_hub"):
        main(["audit", "exposure", "--out", str(tmp_path / "x"), "--", "--target_epsilon", "1", "--push_to_hub"])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags, match", [
    ((), r"give the DP training arguments after `--` \(at least --target_epsilon"),
    (("--target_epsilon", "1", "--output_dir=elsewhere"), "^hf-dp-repr audit exposure: --output_dir / --push_to_hub: "
                                                          "the DP model goes to --out/model"),
    (("--target_epsilon", "1", "--noise_multiplier", "1"), "training arguments: DPTrainingArguments: target_epsilon "
                                                            "and noise_multiplier are both set"),
])
def test_training_flags_are_refused_before_any_work(flags, match, tmp_path):
    """The flags after `--` go through the audits' one parser (audit.inputs.training_flags) with this command's
    refusals; nothing is written."""
    from hf_dp_repr.cli import main

    with pytest.raises(SystemExit, match=match):
        main(["audit", "exposure", "--out", str(tmp_path / "x"), "--", *flags])
    assert not (tmp_path / "x").exists()



def test_the_control_trains_the_scope_dp_trained(tokenizer, tmp_path):
    """With trainable_blocks the non-private control trains the same layers: what DP froze stays equal in both."""
    canaries = draw_canaries(DPRandomness(noise_seed=0), repeats=(1,), never_inserted=0, length=2)
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-3, trainable_blocks=1,
                               per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2, noise_seed=0,
                               report_to="none", save_strategy="no", disable_tqdm=True)
    model = _model(tokenizer)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    texts = load_stdlib_paragraphs()["train"]["text"][:8]
    _, dp, plain = exposure_audit(model, tokenizer, texts, args, canaries, max_length=32)
    moved = {n for n, p in plain.named_parameters() if not torch.equal(p, start[n])}
    frozen = {n for n, p in dp.model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("transformer.h.0.") for n in frozen)  # block 0 is outside the scope
    assert moved and not moved & frozen, moved & frozen  # the control left it alone too
