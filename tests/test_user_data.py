"""A user's own data (hf_dp_repr.data.user_data, docs/your-data.md): the page's files are made by its own python block
and each of its commands runs through the real CLI with a few steps (a CSV with string labels, declared or read off
the rows, a held-out test split, a parquet folder, JSONL chats with a user column, an imagefolder with a local model,
`analyze` on it, `synth` on a `category` column, `audit --run` rebuilding a CSV run's members); bad input is refused
in one typed line before anything is written; a Hub name that cannot be reached fails in one quick line."""

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from hf_dp_repr.cli import main as cli
from hf_dp_repr.data import user_data
from hf_dp_repr.errors import DataError, ModelFileError, RecipeArgumentError

PAGE = Path(__file__).resolve().parents[1] / "docs" / "your-data.md"
FAST = {  # a few steps: what each documented command runs here, appended (the last value of a flag wins)
    "text": ["--max_steps", "1", "--per_device_train_batch_size", "8", "--max_length", "24"],
    "sft": ["--max_steps", "1", "--per_device_train_batch_size", "4", "--lora_r", "2", "--max_length", "64"],
    "image": ["--max_steps", "1", "--per_device_train_batch_size", "8"],
    "synth": ["--max_steps", "1", "--per_device_train_batch_size", "8", "--n_per_label", "1", "--max_new_tokens",
              "2", "--max_length", "24"],
}
COMMON = ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def page_commands() -> dict[str, list[str]]:
    """The page's `hf-dp-repr` commands (continuation lines joined), by their --output_dir / --out."""
    text = PAGE.read_text()
    out = {}
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("hf-dp-repr "):
                argv = shlex.split(line)[1:]
                flag = "--out" if argv[0] == "analyze" else "--output_dir"
                out[argv[argv.index(flag) + 1]] = argv
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The page's files (made by its python block), a local ViT folder (`my-vit`) and a local GPT-2 with its tokenizer
    (`my-gpt2`), in one folder the commands run in."""
    import os

    from hf_dp_repr.data.tokenizer import train_tokenizer
    from hf_dp_repr.tiny import tiny_gpt2, tiny_vit

    folder = tmp_path_factory.mktemp("your-data")
    code = re.search(r"^```python\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)[1]
    before = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, str(PAGE), "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(before)
    tiny_vit(num_labels=3, num_channels=3, image_size=8).save_pretrained(folder / "my-vit")
    tok = train_tokenizer(["Parse the documents of a module into objects and write them back."] * 4, vocab_size=300)
    tiny_gpt2(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
              pad_token_id=tok.eos_token_id).save_pretrained(folder / "my-gpt2")
    tok.save_pretrained(folder / "my-gpt2")
    return folder


def run_page_command(output: str, workdir, monkeypatch, extra=()) -> Path:
    argv = page_commands()[output]
    task = argv[1] if argv[0] == "train" else argv[0]
    argv = argv + FAST.get(task, []) + (COMMON if task in FAST else []) + list(extra)
    monkeypatch.chdir(workdir)
    assert cli(argv) == 0, argv
    return workdir / output


def ledger(run: Path) -> dict:
    return json.loads((run / "privacy_ledger.json").read_text())


def test_the_page_has_the_documented_layouts():
    assert set(page_commands()) == {"out/csv", "out/csv-declared", "out/parquet", "out/topics-analysis", "out/chats",
                                    "out/images", "out/images-public", "out/analysis", "out/synth"}


def test_csv_with_string_labels_read_off_the_rows_says_so_and_holds_out_a_test_split(workdir, monkeypatch, caplog):
    run = run_page_command("out/csv", workdir, monkeypatch)
    config = json.loads((run / "config.json").read_text())
    assert config["id2label"] == {"0": "argparse", "1": "csv", "2": "json"}  # sorted: read off the rows
    assert ledger(run)["dataset_size"] == 72  # 90 rows, 18 (20 %) held out for evaluation
    card = (run / "README.md").read_text()
    assert "was read off the training rows and is published" in card
    assert "18 of the 90 training rows (20%, seed 42) held out for evaluation" in card
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))
    assert "data: the label set (3 classes" in plan and "data: no 'test' split: 18 of the 90" in plan  # in the plan
    assert cli(["audit", "--run", "out/csv", "--out", "out/csv-audit"]) == 0  # the same rows rebuilt from the file
    report = json.loads((workdir / "out" / "csv-audit" / "privacy_audit.json").read_text())
    assert report["members"] == report["ledger_n"] == 72 and report["non_members"] == 18


def test_declared_class_names_keep_their_order_and_the_card_says_nothing_was_read_off(workdir, monkeypatch):
    run = run_page_command("out/csv-declared", workdir, monkeypatch)
    assert json.loads((run / "config.json").read_text())["id2label"] == {"0": "json", "1": "csv", "2": "argparse"}
    assert "read off" not in (run / "README.md").read_text()


def test_a_parquet_folder_gives_its_train_and_test_splits(workdir, monkeypatch):
    run = run_page_command("out/parquet", workdir, monkeypatch)
    assert ledger(run)["dataset_size"] == 70  # train.parquet, evaluated on test.parquet: nothing held out
    assert "held out" not in (run / "README.md").read_text()
    report = run_page_command("out/topics-analysis", workdir, monkeypatch)  # the same folder's string labels
    law = json.loads((report / "representation_law.json").read_text())["models"]["all-MiniLM-L6-v2"]
    assert law["task"] == "text-classification" and law["num_examples"] == 20


def test_jsonl_chats_train_per_user_and_a_user_column_at_row_level_is_warned_about(workdir, monkeypatch, caplog):
    run = run_page_command("out/chats", workdir, monkeypatch)
    assert ledger(run)["privacy_unit"] == "user_id"
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))
    assert "data: no 'test' split: 8 of the 40 training rows" in plan  # the held-out rows, in the plan and the card
    assert "8 of the 40 training rows (20%, seed 42) held out for evaluation" in (run / "README.md").read_text()
    assert "looks like it identifies people" not in caplog.text  # --privacy_unit given: nothing to say
    assert user_data.warn_row_level_users(["messages", "user_id"], "row") == ["user_id"]
    assert "Pass --privacy_unit user_id" in caplog.text
    assert user_data.warn_row_level_users(["messages", "user_id"], "user_id") == []
    assert user_data.user_like_columns(["text", "label", "author", "customer_id", "width"]) == ["author",
                                                                                               "customer_id"]


def test_an_imagefolder_with_a_local_model_trains_and_analyze_reads_the_same_folder(workdir, monkeypatch):
    run = run_page_command("out/images", workdir, monkeypatch)
    n_train = len(list((workdir / "digits_png" / "train").rglob("*.png")))
    assert ledger(run)["dataset_size"] == n_train  # a local pretrained folder: no public share taken
    assert json.loads((run / "config.json").read_text())["id2label"] == {"0": "0", "1": "1", "2": "2"}
    public = run_page_command("out/images-public", workdir, monkeypatch)  # the public images standardise the probe
    assert "100 images of public_png" in (public / "README.md").read_text()
    assert ledger(public)["dataset_size"] == n_train  # none of the user's images taken as public
    report = run_page_command("out/analysis", workdir, monkeypatch)
    law = json.loads((report / "representation_law.json").read_text())
    assert law["models"]["images"]["task"] == "image-classification"


def test_synth_on_a_category_column_uses_the_declared_names_as_control_codes(workdir, monkeypatch):
    from datasets import Dataset

    run = run_page_command("out/synth", workdir, monkeypatch)
    rows = Dataset.from_parquet(str(run / "synthetic" / "synthetic.parquet"))
    assert rows.features["labels"].names == ["json", "csv", "argparse"] and rows.num_rows == 3


# ---- refusals: one typed line, before any work ----------------------------------------------------------------------
def test_bad_input_is_refused_in_one_line_naming_the_fix(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    with pytest.raises(DataError, match=r"--label_column 'kind': no such column; the columns are \['text', "
                                        r"'category'\]"):
        user_data.check_column(["text", "category"], "kind", (), "--label_column")
    with pytest.raises(DataError, match=r"--train_file nope.csv: no such file"):
        user_data.load_user_data(train_file="nope.csv")
    with pytest.raises(DataError, match="unknown data file format '.xlsx'"):
        user_data.data_format("a.xlsx")
    mixed = workdir / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text("text,label\nx,a\n")
    (mixed / "b.jsonl").write_text('{"text": "y", "label": "b"}\n')
    with pytest.raises(DataError, match=r"ambiguous format, the folder holds \{.*csv.*json.*\} files"):
        user_data.load_user_data(str(mixed))
    with pytest.raises(RecipeArgumentError, match="both name the data; give one"):
        user_data.load_user_data("topics", train_file="topics.csv")
    raw = user_data.load_user_data("topics.csv")
    with pytest.raises(DataError, match=r"labels not in --class_names: \['json'\]"):
        user_data.encode_labels(raw, "category", ["csv", "argparse"])
    out = workdir / "refused"
    argv = ["train", "text", "--train_file", "topics.csv", "--label_column", "kind", "--output_dir", str(out),
            "--target_epsilon", "8", "--report_to", "none"]
    assert cli(argv) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (and datasets' progress bar)
    assert errors == ["hf-dp-repr train text: error: --label_column 'kind': no such column; the columns are ['text', "
                      "'category']"]
    assert not out.exists()


def test_integer_labels_without_names_are_left_to_num_labels_and_declared_ones_are_kept():
    import datasets

    raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}))
    assert user_data.encode_labels(raw, "label").names is None  # --num_labels declares them (checks.class_names)
    named = user_data.encode_labels(raw, "label", ["no", "yes"])
    assert named.data["train"].features["label"].names == ["no", "yes"] and not named.read_off_rows
    with pytest.raises(DataError, match=r"labels \[1\] outside the 1 --class_names"):
        user_data.encode_labels(raw, "label", ["only"])


def test_a_missing_eval_split_is_held_out_with_the_seed_and_a_validation_split_is_used_first():
    import datasets

    rows = datasets.Dataset.from_dict({"x": list(range(10))})
    train, evals, note = user_data.hold_out(datasets.DatasetDict(train=rows), "train", "test", 0.2, seed=3)
    assert len(evals) == 2 and not set(train["x"]) & set(evals["x"]) and "2 of the 10 training rows" in note
    again = user_data.hold_out(datasets.DatasetDict(train=rows), "train", "test", 0.2, seed=3)[1]
    assert again["x"] == evals["x"]
    with_validation = datasets.DatasetDict(train=rows, validation=rows.select([0]))
    assert user_data.hold_out(with_validation, "train", "test", 0.2, seed=3)[1]["x"] == [0]
    with pytest.raises(RecipeArgumentError, match="--holdout_fraction 0 holds nothing out"):
        user_data.hold_out(datasets.DatasetDict(train=rows), "train", "test", 0, seed=3)


# ---- no network ------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub_unreachable(monkeypatch):
    """The Hub allowed (HF_HUB_OFFLINE unset, whatever the suite sets) but not reachable: an endpoint on a closed port
    of this machine, so the test does not depend on whether the machine has network."""
    from huggingface_hub import constants

    from hf_dp_repr.data import hub_names

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub_names, "_PROBED", [])


def test_a_hub_name_that_cannot_be_reached_fails_fast_in_one_line(hub_unreachable, tmp_path, capsys):
    from hf_dp_repr.data.hub_names import check_dataset_name

    start = time.monotonic()
    out = tmp_path / "out"
    assert cli(["train", "image", "--model_name_or_path", "made-up/no-such-model", "--output_dir", str(out),
                "--target_epsilon", "8", "--report_to", "none"]) == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'made-up/no-such-model': not found" in err
    assert "http://127.0.0.1:9 cannot be reached" in err and "HF_HUB_OFFLINE=1" in err and "a local path" in err
    assert not out.exists()
    with pytest.raises(DataError, match="--dataset_name 'made-up/no-such-data': not found.*cannot be reached"):
        check_dataset_name("made-up/no-such-data")


def test_analyze_refuses_an_unreachable_model_before_writing(hub_unreachable, tmp_path):
    with pytest.raises(SystemExit, match="hf-dp-repr analyze: error: --model 'made-up/x': not found"):
        cli(["analyze", "--model", "made-up/x", "--dataset", "digits", "--out", str(tmp_path / "a")])
    assert not (tmp_path / "a").exists()
    with pytest.raises(ModelFileError):
        from hf_dp_repr.data.hub_names import check_model_name

        check_model_name("made-up/x")


def test_split_files_and_single_files_of_each_format(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    assert user_data.load_user_data(str(tmp_path / "a.txt"))["train"]["text"] == ["first line", "second line"]
    (tmp_path / "t.jsonl").write_text('{"text": "x", "label": "a"}\n{"text": "y", "label": "b"}\n')
    (tmp_path / "v.jsonl").write_text('{"text": "z", "label": "b"}\n')
    raw = user_data.load_user_data(train_file=str(tmp_path / "t.jsonl"), validation_file=str(tmp_path / "v.jsonl"))
    assert {k: len(v) for k, v in raw.items()} == {"train": 2, "validation": 1}
    with pytest.raises(DataError, match="different formats"):
        user_data.load_user_data(train_file=str(tmp_path / "t.jsonl"), test_file=str(tmp_path / "a.txt"))
    with pytest.raises(RecipeArgumentError, match="give --train_file"):
        user_data.load_user_data(test_file=str(tmp_path / "v.jsonl"))


def test_the_lm_recipe_takes_a_text_file_and_holds_out_its_eval_documents(workdir, tmp_path, monkeypatch):
    import pandas as pd

    texts = pd.read_csv(workdir / "topics.csv")["text"].tolist()
    (tmp_path / "docs.txt").write_text("\n".join(texts) + "\n")
    monkeypatch.chdir(tmp_path)
    assert cli(["train", "lm", "--train_file", "docs.txt", "--public_fraction", "0.5", "--public_epochs", "1",
                "--tokenizer_vocab_size", "300", "--block_size", "32", "--output_dir", "out", "--target_epsilon", "8",
                "--max_steps", "1", "--per_device_train_batch_size", "8", *COMMON]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "docs.txt" in card and "18 of the 90 training rows (20%, seed 42) held out for evaluation" in card


def test_the_dpo_recipe_takes_preference_pairs_as_they_are_or_refuses_other_columns(tmp_path):
    import datasets

    from hf_dp_repr.scripts.dpo import preference_rows

    pairs = datasets.Dataset.from_dict({"prompt": ["p"], "chosen": ["a"], "rejected": ["b"]})
    assert preference_rows(pairs) is pairs
    chats = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": "a"}]], "user_id": ["u"]})
    assert preference_rows(chats).column_names == ["prompt", "chosen", "rejected", "user_id"]
    with pytest.raises(DataError, match=r"needs preference pairs .* the data has the columns \['text'\]"):
        preference_rows(datasets.Dataset.from_dict({"text": ["x"]}))
