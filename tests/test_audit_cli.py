"""`hf-dp-repr audit`: membership inference on a saved run; every bad input refused before anything is written."""

import json

import pytest

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main
from hf_dp_repr.tiny import tiny_vit


@pytest.fixture(scope="module")
def overfit_run(digits, tmp_path_factory):
    """A clipping-only (noise_multiplier=0, ε = ∞) DPTrainer run that memorises 64 digits; saved with its ledger."""
    tmp = tmp_path_factory.mktemp("audit-cli")
    members, non_members = digits["train"].select(range(64)), digits["test"].select(range(64))
    args = DPTrainingArguments(output_dir=str(tmp / "run"), noise_multiplier=0.0, target_delta=1e-3, noise_seed=0,
                               per_device_train_batch_size=32, num_train_epochs=40, learning_rate=3e-3,
                               per_sample_max_grad_norm=10.0, report_to="none", save_strategy="no",
                               logging_strategy="no", disable_tqdm=True)
    model = tiny_vit(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    trainer = DPTrainer(model=model, args=args, train_dataset=members)
    trainer.train()
    trainer.save_model()
    members.save_to_disk(str(tmp / "members"))
    non_members.save_to_disk(str(tmp / "non_members"))
    model.save_pretrained(str(tmp / "no_ledger"))
    # a reference model for the calibrated attack: trained the same way on 64 other training digits
    args.output_dir = str(tmp / "reference")
    reference = DPTrainer(model=tiny_vit(seed=1, hidden_size=32, num_hidden_layers=2, intermediate_size=64), args=args,
                          train_dataset=digits["train"].select(range(64, 128)))
    reference.train()
    reference.save_model()
    return tmp


def test_audit_of_an_overfit_run(overfit_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["audit", "--model", str(overfit_run / "run"), "--members", str(overfit_run / "members"),
                 "--non-members", str(overfit_run / "non_members"), "--out", str(out),
                 "--reference-model", str(overfit_run / "reference")]) == 0
    report = json.loads((out / "privacy_audit.json").read_text())
    assert report["claimed_epsilon"] is None and report["members"] == report["non_members"] == 64
    assert report["attacks"]["loss"]["auc"] > 0.75  # memorised: members have clearly lower loss
    assert report["mean_loss"]["members"] < report["mean_loss"]["non_members"]
    assert set(report["attacks"]) == {"loss", "calibrated"}
    assert report["attacks"]["calibrated"]["auc"] > 0.6  # one reference model: noisier than the loss attack here
    assert "NOT covered by the DP guarantee" in report["not_covered_by_dp"]
    assert (out / "privacy_audit_roc.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "loss attack: AUC" in printed and "calibrated attack: AUC" in printed
    with capsys.disabled():
        print(printed)


def _refused(argv, out, match):
    with pytest.raises(SystemExit, match=match):
        main(argv + ["--out", str(out)])
    assert not out.exists()  # nothing written


def test_model_without_ledger_is_refused(overfit_run, tmp_path):
    _refused(["audit", "--model", str(overfit_run / "no_ledger"), "--members", "digits:train", "--non-members",
              "digits:test"], tmp_path / "r", "no privacy_ledger.json")


def test_empty_and_overlapping_sets_are_refused(overfit_run, digits, tmp_path):
    run = str(overfit_run / "run")
    digits["test"].select([]).save_to_disk(str(tmp_path / "empty"))
    _refused(["audit", "--model", run, "--members", str(tmp_path / "empty"), "--non-members", "digits:test"],
             tmp_path / "r", "is empty")
    overlap = digits["test"].select(range(60, 70))  # rows 60..63 are also in the non-members
    overlap.save_to_disk(str(tmp_path / "overlap"))
    _refused(["audit", "--model", run, "--members", str(tmp_path / "overlap"), "--non-members",
              str(overfit_run / "non_members")], tmp_path / "r", r"4 example\(s\) are both members and non-members")


def test_mismatched_label_spaces_are_refused(overfit_run, digits, tmp_path):
    from datasets import ClassLabel

    run = str(overfit_run / "run")
    five = digits["test"].select(range(100, 120)).cast_column("labels", ClassLabel(names=list("abcdefghij")))
    five.save_to_disk(str(tmp_path / "renamed"))
    _refused(["audit", "--model", run, "--members", str(overfit_run / "members"), "--non-members",
              str(tmp_path / "renamed")], tmp_path / "r", "different label spaces")
    digits_dd = digits  # a DatasetDict without a split named
    digits_dd.save_to_disk(str(tmp_path / "dd"))
    _refused(["audit", "--model", run, "--members", str(tmp_path / "dd"), "--non-members", "digits:test"],
             tmp_path / "r", "name a split")


def test_model_with_another_label_space_is_refused(overfit_run, tmp_path):
    import shutil

    five = tmp_path / "five"
    tiny_vit(num_labels=5).save_pretrained(str(five))
    shutil.copy(overfit_run / "run" / "privacy_ledger.json", five)
    _refused(["audit", "--model", str(five), "--members", str(overfit_run / "members"), "--non-members",
              str(overfit_run / "non_members")], tmp_path / "r", "declares 10 classes but the model has 5 labels")


def test_audit_files_are_never_pushed(tmp_path):
    from hf_dp_repr.hub import files_to_push

    for name in ("privacy_audit.json", "privacy_audit_roc.png", "representation_law.png", "privacy_ledger.json"):
        (tmp_path / name).write_text("x")
    assert files_to_push(tmp_path) == ["privacy_ledger.json", "representation_law.png"]


def test_more_members_than_the_run_trained_on_are_refused(overfit_run, tmp_path):
    """Issue 23: all 1437 rows of digits:train given as members of a run whose ledger says n = 64 (the image recipe
    trains on the private part only): refused, naming both numbers and the fix."""
    _refused(["audit", "--model", str(overfit_run / "run"), "--members", "digits:train", "--non-members",
              str(overfit_run / "non_members")], tmp_path / "r",
             r"--members has 1437 rows but the run trained on n = 64 .*hf-dp-repr audit --run OUTPUT_DIR")


def test_members_are_checked_against_the_ledger_n_and_unit():
    from datasets import Dataset

    from hf_dp_repr.audit.audit_cli import check_members
    from hf_dp_repr.errors import AuditDataError

    rows = Dataset.from_dict({"labels": [0] * 6, "user_id": ["a", "a", "b", "b", "c", "c"]})
    check_members(rows, {"dataset_size": 6, "privacy_unit": "row"})  # all of them
    check_members(rows.select(range(3)), {"dataset_size": 6, "privacy_unit": "row"})  # a sample of them
    with pytest.raises(AuditDataError, match="has 6 rows but the run trained on n = 5"):
        check_members(rows, {"dataset_size": 5, "privacy_unit": "row"})
    check_members(rows, {"dataset_size": 3, "privacy_unit": "user_id"})  # 6 rows of 3 units
    with pytest.raises(AuditDataError, match="3 distinct user_id values but the run trained on n = 2"):
        check_members(rows, {"dataset_size": 2, "privacy_unit": "user_id"})
    with pytest.raises(AuditDataError, match="no 'doc_id' column"):
        check_members(rows, {"dataset_size": 3, "privacy_unit": "doc_id"})
    assert issubclass(AuditDataError, ValueError)


def test_membership_inference_flags_are_required_without_the_canaries_subcommand(tmp_path):
    _refused(["audit", "--members", "digits:train"], tmp_path / "r", "--model, --non-members required")


# ---- --run: a recipe run's members and non-members rebuilt from its run_info.json (issue 29, item 8) ---------------
def test_audit_run_rebuilds_the_members_the_recipe_trained_on(tmp_path, monkeypatch, capsys):
    """A tiny image recipe run (public part split off with --seed 7, a validation part held out): run_info.json
    records the split, and `audit --run` rebuilds exactly the rows DPTrainer was given as members, and the held-out
    rows as non-members."""
    from hf_dp_repr.audit.inputs import fingerprints
    from hf_dp_repr.scripts import image_classification as recipe
    from hf_dp_repr.scripts.run_split import rebuild_members

    given = {}

    class Spy(recipe.DPTrainer):
        def __init__(self, *args, train_dataset=None, eval_dataset=None, **kwargs):
            given.update(members=train_dataset, non_members=eval_dataset)
            super().__init__(*args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)

    monkeypatch.setattr(recipe, "DPTrainer", Spy)
    run = tmp_path / "run"
    recipe.main(["--output_dir", str(run), "--target_epsilon", "8", "--target_delta", "1e-4", "--seed", "7",
                 "--public_fraction", "0.3", "--public_epochs", "1", "--validation_fraction", "0.1",
                 "--max_steps", "1", "--per_device_train_batch_size", "32", "--eval_strategy", "no",
                 "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"])
    split = json.loads((run / "run_info.json").read_text())["split"]
    assert split["public_fraction"] == 0.3 and split["seed"] == 7 and split["dataset_fingerprint"]
    members, non_members = rebuild_members(str(run))
    assert fingerprints(members) == fingerprints(given["members"])
    assert fingerprints(non_members) == fingerprints(given["non_members"])
    assert members.with_format(None)["labels"] == given["members"].with_format(None)["labels"]  # same order
    out = tmp_path / "audit"
    assert main(["audit", "--run", str(run), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_audit.json").read_text())
    assert report["members"] == report["ledger_n"] == len(given["members"]) and report["claimed_epsilon"] <= 8
    assert report["non_members"] == len(given["non_members"])


def test_audit_run_refuses_a_changed_dataset_and_extra_sets(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    info = {"model_args": {"dataset_name": "digits"}, "split": {
        "recipe": "image", "public_fraction": 0.3, "seed": 7, "dataset_fingerprint": "0000", "members": 9,
        "non_members": 1}}
    (run / "run_info.json").write_text(json.dumps(info))
    _refused(["audit", "--run", str(run)], tmp_path / "a", r"fingerprint .* but the run split one with fingerprint "
             r"0000 .*Pass --members and --non-members yourself")
    _refused(["audit", "--run", str(run), "--members", "digits:train"], tmp_path / "b", "drop --members")
    (run / "run_info.json").write_text(json.dumps({"model_args": {}}))
    _refused(["audit", "--run", str(run)], tmp_path / "c", "records no split")


@pytest.mark.slow
def test_audit_run_rebuilds_a_text_recipe_runs_members(tmp_path, monkeypatch):
    """The text recipe on a local GPT-2 folder and a saved dataset: `audit --run` tokenizes the same training rows
    with the run's tokenizer (padded for the audit's batches) and audits them."""
    import datasets

    from hf_dp_repr.scripts import text_classification as recipe
    from hf_dp_repr.scripts.causal_lm import train_tokenizer
    from hf_dp_repr.scripts.run_split import rebuild_members
    from hf_dp_repr.tiny import tiny_gpt2_classifier

    texts = [f"{w} number {i} is here" for i, w in enumerate(["red", "green", "blue", "red green"] * 15)]
    tok = train_tokenizer(texts, vocab_size=300)
    tiny_gpt2_classifier(num_labels=2, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=None).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = {"sentence": texts, "label": [int("red" in t) for t in texts]}
    datasets.Dataset.from_dict(rows).train_test_split(test_size=0.25, seed=0).save_to_disk(str(tmp_path / "data"))
    given = {}

    class Spy(recipe.DPTrainer):
        def __init__(self, *args, train_dataset=None, **kwargs):
            given["members"] = train_dataset
            super().__init__(*args, train_dataset=train_dataset, **kwargs)

    monkeypatch.setattr(recipe, "DPTrainer", Spy)
    run = tmp_path / "run"
    recipe.main(["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"),
                 "--output_dir", str(run), "--target_epsilon", "3", "--target_delta", "1e-3",
                 "--per_device_train_batch_size", "16", "--max_steps", "1", "--save_strategy", "no",
                 "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"])
    members, _ = rebuild_members(str(run))
    unpadded = [ids[:sum(mask)] for ids, mask in zip(members["input_ids"], members["attention_mask"])]
    assert unpadded == given["members"]["input_ids"] and members["labels"] == given["members"]["labels"]
    out = tmp_path / "audit"
    assert main(["audit", "--run", str(run), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_audit.json").read_text())
    assert report["members"] == report["ledger_n"] == 45 and report["non_members"] == 15
