"""The causal-LM recipe (hf_dp_repr.scripts.causal_lm): offline with a locally trained tokenizer, document-level
privacy by default, public / private / eval documents disjoint by content, and a scope beyond its blocks refused."""

import json
import math

import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.scripts import causal_lm as lm_recipe
from hf_dp_repr.scripts import utils as ru


def test_causal_lm_recipe_offline_with_a_locally_trained_tokenizer(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = lm_recipe.main(["--output_dir", str(tmp_path), "--target_epsilon", "8", "--target_delta", "1e-5",
                              "--max_steps", "4", "--per_device_train_batch_size", "32", "--public_epochs", "1",
                              "--tokenizer_vocab_size", "300", "--max_eval_blocks", "64", "--save_strategy", "no",
                              "--report_to", "none", "--disable_tqdm", "true", "--analyze_representations", "true"])
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert 0 < metrics["epsilon"] <= 8
    tok = AutoTokenizer.from_pretrained(tmp_path)  # saved with the model: from_pretrained + generate work
    assert len(tok) == 300
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    out = model.generate(**tok("The", return_tensors="pt"), max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] > 1
    card = (tmp_path / "README.md").read_text()
    assert "to train the tokenizer" in card and "one document (all its blocks) is one unit of privacy" in card
    # document-level by default: the card says so, and its ε is the accountant's ε over documents
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    docs = lm_recipe.load_documents(lm_recipe.LMArguments())[0]["train"]
    n_private = len(docs) - len(docs) // 2  # public_fraction 0.5 of a tiny config: train_test_split's test side
    assert ledger["privacy_unit"] == "document_id" and ledger["dataset_size"] == n_private
    assert ledger["phases"][0]["sample_rate"] == pytest.approx(32 / n_private)
    assert "| unit of privacy | one document (all rows sharing a document_id) |" in card
    assert "document_id-level (ε, δ)-DP" in card
    from hf_dp_repr.privacy.accounting import compute_epsilon

    assert ledger["neighboring"] == "replace_one"  # the default: the ledger and the card state n
    assert metrics["epsilon"] == pytest.approx(compute_epsilon([(ledger["phases"][0]["noise_multiplier"],
                                                                 32 / n_private, 4)], 1e-5, "pld", "replace_one"))
    printed = capsys.readouterr().out  # the result table, with a sample from the DP model
    assert "| test perplexity" in printed and "| ε spent" in printed and "| DP steps  " in printed
    assert "| sample (greedy, DP model) | 'Return the" in printed
    assert json.loads((tmp_path / "representation_law.json").read_text())["analyses"][-1]["residual_law"]


def test_causal_lm_public_private_and_eval_documents_are_disjoint_by_content():
    """Not only by row: a paragraph repeated in the stdlib (87 of 1166 private paragraphs were verbatim copies of
    public ones) is kept once, so no private text is also public or held out, and none is counted twice."""
    from hf_dp_repr.scripts.causal_lm import LMArguments, load_documents

    docs, _ = load_documents(LMArguments())
    public, private = ru.split_public_private(docs["train"], 0.5, seed=0)
    assert len(public) + len(private) == len(docs["train"])
    assert sorted(list(public["text"]) + list(private["text"])) == sorted(docs["train"]["text"])  # a partition

    def norm(texts):
        return [" ".join(t.split()) for t in texts]

    pub, priv, held = norm(public["text"]), norm(private["text"]), norm(docs["eval"]["text"])
    assert len(set(priv)) == len(priv) and len(set(pub)) == len(pub) and len(set(held)) == len(held)
    assert not set(priv) & set(pub) and not set(priv) & set(held) and not set(pub) & set(held)
    from hf_dp_repr.data import stdlib_text

    raw = {" ".join(p.split()) for p in stdlib_text().split("\n\n") if p.strip()}
    assert set(pub) | set(priv) | set(held) == raw  # every distinct paragraph is still there, once


def test_documents_of_a_saved_dataset_are_deduplicated_across_splits(tmp_path):
    import datasets

    from hf_dp_repr.scripts.causal_lm import LMArguments, load_documents

    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ["a b", "c", "a  b", "", "d", "e"]}),
                         test=datasets.Dataset.from_dict({"text": ["d", "f", "f"]})).save_to_disk(tmp_path / "d")
    docs, _ = load_documents(LMArguments(dataset_name=str(tmp_path / "d")))
    assert docs["train"]["text"] == ["a b", "c", "e"] and docs["eval"]["text"] == ["d", "f"]


def test_causal_lm_recipe_refuses_a_scope_beyond_its_blocks_before_public_pretraining(tmp_path, no_pretraining):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="GPT2LMHeadModel has 2 blocks"):
        lm_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--trainable_blocks", "3",
                        "--tokenizer_vocab_size", "300", "--report_to", "none"])
    with pytest.raises(ValueError, match="exceeds the"):
        lm_recipe.main(["--output_dir", str(out), "--target_epsilon", "8", "--per_device_train_batch_size", "100000",
                        "--tokenizer_vocab_size", "300", "--report_to", "none"])
    assert not out.exists()


def test_causal_lm_recipe_unit_flag(tmp_path):
    from hf_dp_repr.scripts.causal_lm import document_level

    def args(**kw):
        return DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, report_to="none", **kw)

    default = args()
    assert document_level(default, set()) and default.privacy_unit == "document_id"
    block = args(privacy_unit="block")
    assert not document_level(block, {"privacy_unit"}) and block.privacy_unit == "row"
    with pytest.raises(ValueError, match="needs poisson_sampling=True"):
        document_level(args(poisson_sampling=False), set())  # re-checked after the recipe sets the unit
    with pytest.raises(ValueError, match="supports 'document_id'"):
        document_level(args(privacy_unit="user_id"), {"privacy_unit"})
