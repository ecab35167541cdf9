"""The DP model card states the run's facts, and the Hub push sends exactly the DP run's files (captured, no
network)."""

import json
import math

import pytest
from huggingface_hub import ModelCard

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.hub import push_dp_model
from hf_dp_repr.hub.card import format_epsilon, render_model_card, template_path, write_model_card
from hf_dp_repr.privacy.accounting import compute_epsilon
from hf_dp_repr.tiny import tiny_vit


def _ledger(**over):
    history = [[1.25, 0.05, 200]]
    led = dict(accountant="pld", target_delta=1e-5, per_sample_max_grad_norm=0.5, clipping="per_layer",
               dataset_size=1280, poisson_sampling=True, target_epsilon=4.0, world_size=2, neighboring="replace_one",
               phases=[dict(name="train", noise_multiplier=1.25, sample_rate=0.05, steps=200, expected_batch_size=64)],
               history=history, steps_done=200, planned_steps=200)
    led.update(over)
    led["epsilon"] = compute_epsilon([tuple(h) for h in led["history"]], led["target_delta"], led["accountant"],
                                     led.get("neighboring", "add_remove"))
    return led


def _law_file(tmp_path):
    fit = {"rho": 0.4321, "intercept": 1.0, "r": -0.987, "layers": [0, 1, 2, 3, 4]}
    res = {"rho": 0.8765, "intercept": 0.0, "r": -0.95, "layers": [1, 2, 3, 4]}
    (tmp_path / "representation_law.json").write_text(json.dumps({"analyses": [
        {"event": "train_end", "step": 200, "epoch": 10, "fuzziness_law": fit, "residual_law": res}]}))
    (tmp_path / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.9123, "eval_runtime": 1.5,
                                                           "train_loss": 0.3, "epsilon": 2.5}))


def test_card_states_the_guarantee_data_scope_versions_and_laws(tmp_path):
    _law_file(tmp_path)
    led = _ledger()
    card = render_model_card(led, scope="last 2 of 4 blocks + head (classifier)", output_dir=tmp_path,
                             model_card_info={"private_data": "PRIVATE-SET-XYZ", "public_data": "PUBLIC-SET-ABC",
                                              "base_model": "google/vit-base-patch16-224-in21k",
                                              "datasets": ["cifar10"]})
    text = card.text
    eps = format_epsilon(led["epsilon"])
    assert f"**{eps}**" in text and f"(ε = {eps}, δ = 1e-05)-differentially private" in text
    for fact in ("| δ | 1e-05 |", "| target ε | 4 |", "pld (dp_accounting)", "| noise multiplier σ | 1.25 |",
                 "| per-example clipping norm C | 0.5 (per_layer clipping) |",
                 "Poisson batches, sample rate q = 0.05 (expected logical batch 64)",
                 "| steps taken / planned | 200 / 200 |",
                 "| epochs, as the Trainer counts them | 10 |", "| expected passes over the data (Σ q × steps) | 10 |",
                 "| private training examples (n) | 1280 |", "| processes | 2 |",
                 "PRIVATE-SET-XYZ", "PUBLIC-SET-ABC", "last 2 of 4 blocks + head (classifier)",
                 "google/vit-base-patch16-224-in21k", "| eval_accuracy | 0.9123 |",
                 "| separation fuzziness D_l | 0.4321 | -0.987 | 0..4 |",
                 "| prediction residual PR_l | 0.8765 | -0.95 | 1..4 |"):
        assert fact in text, fact
    import opacus
    import torch
    import transformers

    for lib in (torch, transformers, opacus):
        assert f"- {lib.__name__} {lib.__version__}" in text
    assert "eval_runtime" not in text and "train_loss" not in text  # timings, and a loss on private data
    assert "NOT differentially private" not in text and "### Phases" not in text
    assert "differential-privacy" in card.data.tags
    assert card.data.base_model == "google/vit-base-patch16-224-in21k" and card.data.datasets == ["cifar10"]
    assert ModelCard(str(card)).data.tags == card.data.tags  # the metadata block round-trips


def test_card_of_a_two_phase_run_has_a_phase_table(tmp_path):
    phases = [dict(name="linear_probe", noise_multiplier=2.0, sample_rate=0.1, steps=30, expected_batch_size=128),
              dict(name="fine_tune", noise_multiplier=3.5, sample_rate=0.05, steps=70, expected_batch_size=64)]
    led = _ledger(phases=phases, history=[[2.0, 0.1, 30], [3.5, 0.05, 70]], steps_done=100, planned_steps=100)
    text = render_model_card(led).text
    assert "### Phases" in text and "per phase, see the table below" in text
    assert "| linear_probe | 2 | 0.1 | 128 | 30 |" in text and "| fine_tune | 3.5 | 0.05 | 64 | 70 |" in text
    assert "| expected passes over the data (Σ q × steps) | 6.5 |" in text  # 30·0.1 + 70·0.05
    assert "| epochs, as the Trainer counts them | 5 |" in text  # 100 steps of ⌊1280 / 64⌋ = 20


def test_card_of_a_legacy_scalar_ledger(tmp_path):
    led = _ledger()
    del led["phases"]
    led.update(noise_multiplier=1.25, sample_rate=0.05, expected_batch_size=64)
    assert "| noise multiplier σ | 1.25 |" in render_model_card(led).text


def test_non_private_and_non_poisson_runs_are_flagged():
    led = _ledger(history=[[0.0, 0.05, 200]],
                  phases=[dict(name="train", noise_multiplier=0.0, sample_rate=0.05, steps=200,
                               expected_batch_size=64)])
    assert math.isinf(led["epsilon"])
    text = render_model_card(led).text
    assert "NOT differentially private (ε = ∞)" in text and "-differentially private." not in text
    text = render_model_card(_ledger(poisson_sampling=False)).text
    assert "is **not** a proven guarantee" in text and "shuffled fixed-size batches" in text


def _non_private_ledger():
    q = 128 / 1006  # the demo's reference run: 1006 private examples, logical batch 128, 30 epochs of 7 steps
    return _ledger(history=[[0.0, q, 210]], target_epsilon=None, dataset_size=1006, steps_done=210,
                   planned_steps=210, phases=[dict(name="train", noise_multiplier=0.0, sample_rate=q, steps=210,
                                                   expected_batch_size=128)])


def test_card_of_a_non_private_reference_says_what_it_is():
    from hf_dp_repr.hub.card import NON_PRIVATE_TAGS

    card = render_model_card(_non_private_ledger(), model_card_info={"model_name": "tiny_vit fine-tuned on digits"})
    text = card.text
    assert text.lstrip().startswith("# tiny_vit fine-tuned on digits: non-private reference\n")
    assert card.data.tags == NON_PRIVATE_TAGS and not {"differential-privacy", "dp-sgd", "opacus"} & set(card.data.tags)
    assert ModelCard(str(card)).data.tags == NON_PRIVATE_TAGS
    assert "NOT differentially private (ε = ∞)" in text and "**no noise**" in text
    for claim in ("differentially private SGD", "DP-SGD", "DP fine-tuned", "Privacy guarantee", "trained under DP",
                  "-differentially private."):
        assert claim not in text, claim
    assert render_model_card(_non_private_ledger()).text.lstrip().startswith("# Non-private reference model\n")
    private = render_model_card(_ledger(), model_card_info={"model_name": "tiny_vit fine-tuned on digits"})
    assert private.text.lstrip().startswith("# tiny_vit fine-tuned on digits (DP-SGD, ε = ")


def test_card_gives_the_trainers_epochs_and_the_expected_passes_with_the_reason():
    text = render_model_card(_non_private_ledger()).text
    assert "(30 epochs as the Trainer counts them,\n26.72 expected passes over the data)" in text
    assert "the Trainer counts ⌊n / batch⌋ = 7 steps (logical batch 128) as an epoch" in text
    assert "Σ q × steps =\n26.72; the two differ when n is not a multiple of the batch" in text
    q = 128 / 1006
    text = render_model_card(_ledger(history=[[1.0, q, 210]], dataset_size=1006, steps_done=210, planned_steps=210,
                                     phases=[dict(name="train", noise_multiplier=1.0, sample_rate=q, steps=210,
                                                  expected_batch_size=128)])).text
    assert "| epochs, as the Trainer counts them | 30 |" in text
    assert "| expected passes over the data (Σ q × steps) | 26.72 |" in text


def test_card_states_how_the_noise_was_drawn_and_the_neighbouring_relation():
    led = _ledger(accountant="rdp", neighboring="add_remove")
    del led["neighboring"]  # ledgers without the fields: OS entropy, add/remove
    text = render_model_card(led).text
    assert "| noise and batch sampling | drawn from OS entropy (no seed reproduces them) |" in text
    assert ("| neighbouring relation | add/remove one example for the plan's ε, which needs n secret; replace one "
            "example for the guarantee above |") in text
    assert "Not private as released" not in text
    text = render_model_card(_ledger(randomness="seeded")).text
    assert ("| noise and batch sampling | seeded with noise_seed: NOT private, anyone who knows the seed can remove "
            "the noise |") in text
    assert "| neighbouring relation | replace one example (n is public: this card states it) |" in text
    assert "**Not private as released:**" in text.split("## Privacy guarantee")[0]  # said under the title


def test_template_is_the_one_in_model_cards():
    from pathlib import Path

    shipped = Path(template_path())
    root = Path(__file__).resolve().parents[1]
    assert shipped.read_text() == (root / "model_cards" / "dp_model_card.md").read_text()
    # one file: the package ships it through a symbolic link, not a second copy to keep in step
    assert [p.name for p in (root / "hf_dp_repr").rglob("*.md") if not p.is_symlink()] == []


# ---- a real run: the card at every save, and the push ----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("card_run")
    args = DPTrainingArguments(output_dir=str(out), target_epsilon=3.0, target_delta=1e-4, max_steps=3,
                               per_device_train_batch_size=32, learning_rate=1e-3, report_to="none",
                               save_strategy="steps", save_steps=3, disable_tqdm=True)
    data = load_digits_dataset()
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=data["train"])
    trainer.model_card_info = {"private_data": "digits train split"}
    trainer.train()
    trainer.save_model()
    return trainer, out


def test_every_save_writes_the_card_next_to_the_ledger(trained):
    trainer, out = trained
    for folder in (out, out / "checkpoint-3"):
        card = ModelCard.load(folder / "README.md")
        ledger = json.loads((folder / "privacy_ledger.json").read_text())
        assert f"**{format_epsilon(ledger['epsilon'])}**" in card.text and "digits train split" in card.text
        assert "differential-privacy" in card.data.tags
        assert f"| epochs, as the Trainer counts them | {trainer.state.epoch:.4g} |" in card.text
    assert write_model_card(trainer, out).text == ModelCard.load(out / "README.md").text


def test_card_refreshed_from_the_folder_alone_keeps_what_the_caller_said(trained, tmp_path):
    import shutil

    from hf_dp_repr.hub.card import refresh_model_card

    trainer, out = trained
    folder = tmp_path / "copy"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    before = (folder / "README.md").read_text()
    assert refresh_model_card(folder).text == ModelCard(before).text and "digits train split" in before
    (folder / "privacy_ledger.json").write_text("{not json")
    with pytest.raises(ValueError, match="privacy_ledger.json is not valid JSON"):
        refresh_model_card(folder)


def test_push_sends_weights_metrics_laws_ledger_and_card_only(trained, hub, capsys):
    trainer, out = trained
    _law_file(out)
    (out / "representation_law.png").write_bytes(b"png")
    token = b"hf_write_someone"  # the HF_TOKEN the push uses (the hub fixture's)
    trainer.args.hub_model_id = "someone/dp-digits"
    card_before = (out / "README.md").read_bytes()
    with pytest.raises(ValueError, match="all_results.json holds train_loss, computed on the private data"):
        push_dp_model(trainer)  # an all_results.json not written by DPTrainer.save_metrics
    assert hub.repos == {} and (out / "README.md").read_bytes() == card_before
    (out / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.9123, "eval_runtime": 1.5, "epsilon": 2.5}))
    push_dp_model(trainer)
    assert not hub.repos["someone/dp-digits"].private and hub.calls("POST", "/api/validate-yaml")
    assert hub.pushes("someone/dp-digits") == [["README.md", "all_results.json", "config.json", "model.safetensors",
                                                "privacy_ledger.json", "representation_law.json",
                                                "representation_law.png"]]
    card = ModelCard.load("someone/dp-digits")  # from the Hub
    assert "differential-privacy" in card.data.tags and "| eval_accuracy | 0.9123 |" in card.text
    assert json.loads(hub.repos["someone/dp-digits"].files["privacy_ledger.json"])["steps_done"] == 3
    printed = capsys.readouterr()
    assert token.decode() not in printed.out + printed.err
    for path in out.rglob("*"):
        if path.is_file():
            assert token not in path.read_bytes(), path
    assert not [name for name, data in hub.repos["someone/dp-digits"].files.items() if token in data]


def test_trainer_push_to_hub_sends_the_dp_card_through_the_allow_list(trained, hub):
    trainer, out = trained
    trainer.args.hub_model_id = "someone/dp-digits-2"
    trainer.create_model_card(model_name="x")  # the Trainer's generic card must not replace the DP card
    assert "differential-privacy" in ModelCard.load(out / "README.md").data.tags
    trainer.push_to_hub(commit_message="test push")
    repo = hub.repos["someone/dp-digits-2"]
    assert repo.commits[-1].title == "test push"
    assert "training_args.bin" not in repo.files and "privacy_ledger.json" in repo.files
    assert "differential-privacy" in ModelCard.load("someone/dp-digits-2").data.tags


def test_hub_token_in_arguments_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hub_token would be pickled.*HF_TOKEN"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, hub_token="hf_x")
