"""DP synthetic text (hf_dp_repr.synth): the prompts and the rows' provenance owe nothing to the private rows but
through the DP model, the dataset card states the model's ε, and the dataset push goes through its allow-list to a
dataset repository on the local Hub (tests/hub_server.py)."""

import json
from pathlib import Path

import pytest
from datasets import ClassLabel, Dataset, Features, Value
from huggingface_hub import DatasetCard, HfApi, hf_hub_download

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.data.control_codes import control_rows
from hf_dp_repr.data.tokenizer import padded_rows, train_tokenizer
from hf_dp_repr.errors import DataError, LedgerError
from hf_dp_repr.hub.card import format_epsilon
from hf_dp_repr.hub.dataset_push import check_dataset_pushable, push_synthetic_dataset
from hf_dp_repr.synth import generate_synthetic, save_synthetic
from hf_dp_repr.tiny import tiny_gpt2

PLANTED = "zqxjvoordprivate7731"  # a string no public text holds: it may only be reached through the model
NAMES = ["json", "csv", "email"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    texts = [f"Parse a {n} document number {i} into objects." for i in range(8) for n in NAMES]
    texts[5] = f"The secret of this row is {PLANTED}."
    private = Dataset.from_dict({"text": texts, "labels": [i % 3 for i in range(len(texts))]},
                                features=Features({"text": Value("string"), "labels": ClassLabel(names=NAMES)}))
    tok = train_tokenizer(["Parse the documents of a module into objects."] * 4, vocab_size=300)  # public text
    model = tiny_gpt2(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id)
    args = DPTrainingArguments(output_dir=str(out / "model"), target_epsilon=2.0, target_delta=1e-3, max_steps=3,
                               per_device_train_batch_size=8, learning_rate=1e-2, report_to="none",
                               save_strategy="no", disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=padded_rows(control_rows(private), tok, 32),
                        processing_class=tok)
    trainer.train()
    trainer.save_model()
    seen = []  # every text the tokenizer is asked to encode while sampling
    real_call = type(tok).__call__

    def spy(self, text, *a, **k):
        seen.extend([text] if isinstance(text, str) else list(text))
        return real_call(self, text, *a, **k)

    type(tok).__call__ = spy
    try:
        synthetic = generate_synthetic(trainer.model, tok, NAMES, 4, max_new_tokens=8, batch_size=3, seed=1)
    finally:
        type(tok).__call__ = real_call
    folder = save_synthetic(synthetic, out / "synthetic", trainer.ledger.to_dict(),
                            dict(model="tiny_gpt2", n_per_label=4, temperature=1.0, top_p=1.0, max_new_tokens=8,
                                 seed=1))
    return dict(trainer=trainer, synthetic=synthetic, folder=folder, seen=seen, out=out, tok=tok)


def test_prompts_are_the_control_codes_only(run):
    assert sorted(set(run["seen"])) == sorted(f"{n}:" for n in NAMES)  # nothing else reached the tokenizer
    record = json.loads((run["folder"] / "synthesis.json").read_text())
    assert record["prompts"] == ["json:", "csv:", "email:"] and record["rows"] == 12
    assert run["synthetic"]["labels"] == [0] * 4 + [1] * 4 + [2] * 4
    for path in run["folder"].iterdir():  # card, record, ledger: the planted row can only be in model output
        if path.suffix != ".parquet":
            assert PLANTED not in path.read_text(), path.name


def test_the_dataset_card_states_the_models_epsilon(run):
    card = DatasetCard.load(run["folder"] / "README.md")
    eps = run["trainer"].ledger.epsilon()
    assert card.data.to_dict()["hf_dp_repr"]["epsilon"] == eps
    assert f"ε = {format_epsilon(eps)}" in card.text
    assert f"ε = {format_epsilon(eps)}" in (run["out"] / "model" / "README.md").read_text()  # the model card's
    assert json.loads((run["folder"] / "privacy_ledger.json").read_text())["epsilon"] == eps
    assert Dataset.from_parquet(str(run["folder"] / "synthetic.parquet")).features["labels"].names == NAMES


def test_save_synthetic_refuses_a_missing_ledger(run, tmp_path):
    with pytest.raises(LedgerError, match="ledger"):
        save_synthetic(run["synthetic"], tmp_path, {}, {})
    assert not list(tmp_path.iterdir())


def test_dataset_push_sends_the_allow_list_only(run, hub, tmp_path):
    folder = Path(tmp_path / "release")
    folder.mkdir()
    for path in run["folder"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    decoys = {"private_rows.parquet": b"x", "train.parquet": b"x", "notes.txt": PLANTED.encode(),
              ".env": b"HF_TOKEN=x", "raw/private.json": PLANTED.encode(), "training_args.bin": b"x"}
    for name, data in decoys.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
    push_synthetic_dataset(folder, "someone/dp-synthetic")
    sent = HfApi().list_repo_files("someone/dp-synthetic", repo_type="dataset")
    assert sent == [".gitattributes", "README.md", "privacy_ledger.json", "synthesis.json", "synthetic.parquet"]
    got = hf_hub_download("someone/dp-synthetic", "synthetic.parquet", repo_type="dataset")
    assert Path(got).read_bytes() == (folder / "synthetic.parquet").read_bytes()
    assert "someone/dp-synthetic" not in hub.repos  # a dataset repository, not a model one


def test_dataset_push_refuses_other_prompts_or_no_ledger(run, tmp_path):
    folder = Path(tmp_path)
    for path in run["folder"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    record = json.loads((folder / "synthesis.json").read_text())
    (folder / "synthesis.json").write_text(json.dumps({**record, "prompts": [f"json: {PLANTED}", "csv:", "email:"]}))
    with pytest.raises(DataError, match="not the control"):
        check_dataset_pushable(folder)
    (folder / "privacy_ledger.json").unlink()
    with pytest.raises(LedgerError, match="privacy_ledger.json"):
        check_dataset_pushable(folder)


@pytest.mark.slow
def test_the_synth_command_end_to_end(tmp_path, hub, capsys):
    from hf_dp_repr.cli import main

    main(["synth", "--output_dir", str(tmp_path / "run"), "--target_epsilon", "4", "--target_delta", "1e-4",
          "--max_steps", "2", "--per_device_train_batch_size", "32", "--public_epochs", "0.05", "--n_per_label", "2",
          "--max_new_tokens", "6", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
          "--push_to_hub", "--hub_dataset_id", "someone/synth-e2e"])
    folder = tmp_path / "run" / "synthetic"
    rows = Dataset.from_parquet(str(folder / "synthetic.parquet"))
    assert rows.num_rows == 32 and len(rows.features["labels"].names) == 16  # 2 per stdlib-topics module
    eps = json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())["epsilon"]
    assert DatasetCard.load(folder / "README.md").data.to_dict()["hf_dp_repr"]["epsilon"] == eps
    assert "synthetic dataset: 32 rows" in capsys.readouterr().out
    assert HfApi().list_repo_files("someone/synth-e2e", repo_type="dataset") == [
        ".gitattributes", "README.md", "privacy_ledger.json", "synthesis.json", "synthetic.parquet"]
