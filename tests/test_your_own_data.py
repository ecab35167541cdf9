"""A user's first own run (issue 40.2, 40.3): nothing private is used without DP unless the user says so, the result
table says what was trained with DP, and the DP-aware defaults (hf_dp_repr.scripts.dp_defaults)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.errors import RecipeArgumentError
from hf_dp_repr.scripts import image_classification as image_recipe
from hf_dp_repr.scripts import recipe_report
from hf_dp_repr.training.plan import plan_run


def _npz(path, n=40):
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8), y_train=np.arange(n) % 2,
             x_test=rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8), y_test=np.arange(6) % 2,
             class_names=np.array(["a", "b"]))
    return str(path)


def test_a_random_init_model_on_your_own_data_is_refused_in_one_line(tmp_path, capsys):
    """The default tiny ViT (random init) on the user's images took half of them as public data, trained on without
    DP; now refused before any work, naming the three fixes; with --public_fraction it runs as asked."""
    from hf_dp_repr.cli import main

    out = tmp_path / "out"
    code = main(["train", "image", "--dataset_name", _npz(tmp_path / "mine.npz"), "--output_dir", str(out),
                 "--target_epsilon", "8", "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert all(f in err for f in ("--model_name_or_path", "public dataset", "--public_fraction")), err
    assert not out.exists()


def test_the_result_table_says_what_was_trained_with_dp_and_what_without():
    args = DPTrainingArguments(output_dir="/tmp/t", target_epsilon=8, target_delta=1e-4, max_steps=3,
                               per_device_train_batch_size=16, report_to="none")
    ledger = SimpleNamespace(plan=plan_run(args, 160), steps_done=3)
    table = recipe_report.result_table({"eval_accuracy": 0.5, "epsilon": 7.9}, ledger, "test", public_fraction=0.5)
    assert "| examples trained with DP" in table and "160 (the 50% of the training split not used as public" in table
    assert "50% of the training split, trained on WITHOUT DP" in table
    assert "public" not in recipe_report.result_table({"epsilon": 7.9}, ledger, "test")  # no public data: no row


def test_the_image_recipe_still_refuses_before_reading_the_data(tmp_path):
    with pytest.raises(RecipeArgumentError, match="randomly initialised"):
        image_recipe.main(["--dataset_name", str(tmp_path / "none.npz"), "--output_dir", str(tmp_path / "o"),
                           "--target_epsilon", "8", "--report_to", "none"])


# ---- DP-aware defaults ---------------------------------------------------------------------------------------------
def test_the_rule_chooses_a_probe_with_a_large_batch_from_public_quantities_only():
    from hf_dp_repr.scripts.dp_defaults import choose

    chosen = choose(n=228, epsilon=8.0, given=set()).values
    assert chosen == {"trainable_blocks": 0, "head_init": "zeros", "clipping": "automatic",
                      "per_device_train_batch_size": 57, "num_train_epochs": 40, "optim": "sgd", "learning_rate": 7.2}
    assert choose(n=100_000, epsilon=1.0, given=set()).values["per_device_train_batch_size"] == 1024  # capped
    assert choose(n=1000, epsilon=1.0, given=set()).values["learning_rate"] == 0.9  # grows with ε
    assert choose(n=1000, epsilon=100.0, given=set()).values["learning_rate"] == 8.0  # capped
    assert choose(n=1000, epsilon=8.0, given=set(), feature_norm=72.0).values["learning_rate"] == 0.1  # DINOv2's


def test_every_explicit_flag_wins_and_the_rest_follows_it():
    """Each option given replaces its own value only: a learning rate given used to turn the whole rule off (scope,
    optimizer, clipping back to the library's); now the probe, SGD and automatic clipping are still chosen."""
    from hf_dp_repr.scripts.dp_defaults import choose

    given = {"per_device_train_batch_size", "learning_rate", "max_steps"}
    chosen = choose(n=1000, epsilon=8.0, given=given).values
    assert not given & set(chosen) and "num_train_epochs" not in chosen  # max_steps given: no epochs chosen
    assert (chosen["trainable_blocks"], chosen["optim"], chosen["clipping"]) == (0, "sgd", "automatic")
    blocks = choose(n=1000, epsilon=8.0, given={"trainable_blocks"}, trainable_blocks=2).values
    assert "trainable_blocks" not in blocks and "head_init" not in blocks
    assert (blocks["optim"], blocks["learning_rate"], blocks["num_train_epochs"]) == ("adamw_torch", 5e-4, 10)
    assert blocks["per_device_train_batch_size"] * blocks["gradient_accumulation_steps"] == 224  # micro-batches of 32
    assert choose(n=1000, epsilon=8.0, given={"optim"}, optim="sgd").values["learning_rate"] == 7.2
    # adaptive clipping follows a quantile of flat norms: the rule leaves clipping alone (it chose 'automatic',
    # which the engine refuses beside adaptive clipping: test_ddp's adaptive run failed)
    assert "clipping" not in choose(n=1000, epsilon=8.0, given={"adaptive_clipping"}).values
    assert choose(n=1000, epsilon=8.0, given={"optim"}, optim="adamw_torch").values["learning_rate"] == 0.05


def test_the_recipe_applies_the_defaults_says_why_and_keeps_a_given_flag(tmp_path, caplog):
    import json
    import logging

    argv = ["--dataset_name", _npz(tmp_path / "mine.npz", n=80), "--public_fraction", "0.5", "--public_epochs", "1",
            "--target_epsilon", "8", "--target_delta", "1e-4", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true"]
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        image_recipe.main(argv + ["--output_dir", str(tmp_path / "a")])
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))
    assert "DP-aware defaults" in plan and "--trainable_blocks 0: a linear probe" in plan  # in the plan itself
    plan = json.loads((tmp_path / "a" / "privacy_ledger.json").read_text())
    assert plan["phases"][0]["expected_batch_size"] == 16 and plan["phases"][0]["steps"] == 40 * 2  # n = 40 private
    image_recipe.main(argv + ["--output_dir", str(tmp_path / "b"), "--per_device_train_batch_size", "4"])
    plan = json.loads((tmp_path / "b" / "privacy_ledger.json").read_text())
    assert plan["phases"][0]["expected_batch_size"] == 4  # the user's flag wins


def test_a_hopeless_update_snr_is_warned_before_training_naming_the_fixes(caplog):
    import logging

    from hf_dp_repr.privacy.ledger import Phase
    from hf_dp_repr.training.privacy_report import LOW_UPDATE_SNR, warn_if_noise_drowns_updates

    with caplog.at_level(logging.WARNING):
        warn_if_noise_drowns_updates(Phase("train", 0.6345, 8 / 228, 86, 8), 22_713_606)  # the run
    assert "378× the norm" in caplog.text and "trainable_blocks=0" in caplog.text and "larger expected batch" in \
        caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_if_noise_drowns_updates(Phase("train", 3.76, 0.25, 160, 102), 384 * 6 + 6)  # the defaults' probe
    assert not caplog.text and LOW_UPDATE_SNR > 0.0026


def test_a_learning_rate_given_keeps_the_rest_of_the_rule_and_dp_defaults_off_keeps_the_trainers(tmp_path, caplog):
    """--learning_rate alone replaces the learning rate only (before, it turned the rule off: every parameter trained
    with AdamW at the given rate); `--dp_defaults off` is the switch back to the library's and the Trainer's
    defaults (every parameter trains, batch 8), and the plan says so."""
    import json
    import logging

    argv = ["--dataset_name", _npz(tmp_path / "mine.npz", n=80), "--public_fraction", "0.5", "--public_epochs", "1",
            "--target_epsilon", "8", "--target_delta", "1e-4", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--learning_rate", "0.3", "--max_steps", "2"]
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        image_recipe.main(argv + ["--output_dir", str(tmp_path / "a")])
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))
    assert "--trainable_blocks 0" in plan and "--optim sgd" in plan and "--learning_rate" not in plan
    assert "trains linear probe: head (classifier)" in plan
    assert json.loads((tmp_path / "a" / "privacy_ledger.json").read_text())["phases"][0]["expected_batch_size"] == 16
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        image_recipe.main(argv + ["--output_dir", str(tmp_path / "b"), "--dp_defaults", "off"])
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))
    assert "DP-aware defaults: off" in plan and "trains all parameters" in plan
    assert json.loads((tmp_path / "b" / "privacy_ledger.json").read_text())["phases"][0]["expected_batch_size"] == 8


# ---- DP-aware defaults of the language recipes ----------------------------------------------------------------------
def test_the_language_rule_chooses_scope_batch_and_rate_from_public_quantities():
    from hf_dp_repr.scripts.dp_defaults import choose_language

    big = choose_language(2000, set(), parameters=360_000_000, pretrained=True, peft_available=True).values
    assert (big["use_lora"], big["optim"], big["learning_rate"], big["num_train_epochs"]) == (True, "adamw_torch",
                                                                                             1e-3, 10)
    assert (big["per_device_train_batch_size"], big["gradient_accumulation_steps"]) == (8, 62)  # 496 ≈ n/4
    assert choose_language(2000, set(), 360_000_000, True, peft_available=False).values["use_lora"] is False
    built = choose_language(2000, set(), 50_000, pretrained=False, peft_available=True).values
    assert (built["use_lora"], built["learning_rate"]) == (False, 5e-4)  # every parameter of a model built here
    given = {"use_lora", "learning_rate", "max_steps", "gradient_accumulation_steps"}
    chosen = choose_language(2000, given, 360_000_000, True, True, use_lora=False, gradient_accumulation_steps=2).values
    assert not given & set(chosen) and "num_train_epochs" not in chosen
    assert chosen["per_device_train_batch_size"] == 8 and chosen["optim"] == "adamw_torch"


def _plan(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("DP-SGD plan"))


def test_train_lm_applies_the_rule_says_why_in_the_plan_and_keeps_a_given_flag(tmp_path, caplog):
    """`train lm` with no training hyperparameter: the expected batch is a quarter of the private documents (the
    Trainer's was 8), AdamW at 5e-4 on every parameter of the tiny model, and the plan says why; a batch given wins."""
    import json
    import logging

    from hf_dp_repr.scripts import causal_lm

    argv = ["--target_epsilon", "8", "--target_delta", "1e-5", "--max_steps", "1", "--public_epochs", "1",
            "--public_model_dir", str(tmp_path / "public"), "--max_eval_blocks", "8", "--sample_prompt", "",
            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        causal_lm.main(argv + ["--output_dir", str(tmp_path / "a")])
    plan = _plan(caplog)
    assert "--use_lora False" in plan and "--learning_rate 0.0005" in plan and "--optim adamw_torch" in plan
    ledger = json.loads((tmp_path / "a" / "privacy_ledger.json").read_text())
    n = ledger["dataset_size"]  # private documents
    assert ledger["phases"][0]["expected_batch_size"] == 8 * (round(n / 4) // 8) > 100
    causal_lm.main(argv + ["--output_dir", str(tmp_path / "b"), "--per_device_train_batch_size", "4"])
    ledger = json.loads((tmp_path / "b" / "privacy_ledger.json").read_text())
    assert ledger["phases"][0]["expected_batch_size"] == 4  # accumulation is not chosen with a batch given


def test_train_sft_applies_the_rule_and_a_given_use_lora_wins(tmp_path, caplog):
    """`train sft` on the built-in chats, with --use_lora true given: the adapters train (the flag wins), at the
    rule's LoRA rate with a quarter of the users per expected batch, and the plan says why."""
    import json
    import logging

    from hf_dp_repr.scripts import sft

    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        sft.main(["--use_lora", "true", "--lora_r", "2", "--max_length", "64",
                  "--max_steps", "1", "--target_epsilon", "8", "--target_delta", "1e-3", "--output_dir",
                  str(tmp_path / "sft"), "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"])
    plan = _plan(caplog)
    assert "--learning_rate 0.001" in plan and "--use_lora" not in plan and "trains PEFT adapters" in plan
    ledger = json.loads((tmp_path / "sft" / "privacy_ledger.json").read_text())
    n = ledger["dataset_size"]  # users
    assert n >= 32 and ledger["phases"][0]["expected_batch_size"] == 8 * (max(16, round(n / 4)) // 8)  # TRL's: 8


def test_train_dpo_applies_the_rule_too(tmp_path, caplog):
    """`train dpo` on the built-in chats' preference pairs (one user per unit), adapters asked for: the LoRA rate and
    a quarter of the users per expected batch are chosen (TRL's DPO defaults were batch 8, learning rate 1e-6)."""
    import json
    import logging

    from hf_dp_repr.scripts import dpo

    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        dpo.main(["--use_lora", "true", "--lora_r", "2", "--max_length", "256", "--max_steps", "1",
                  "--target_epsilon", "8", "--target_delta", "1e-3", "--output_dir", str(tmp_path / "dpo"),
                  "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"])
    plan = _plan(caplog)
    assert "--learning_rate 0.001" in plan and "--gradient_accumulation_steps 2" in plan
    ledger = json.loads((tmp_path / "dpo" / "privacy_ledger.json").read_text())
    assert ledger["phases"][0]["expected_batch_size"] == 16  # n = 40 users: max(16, 40 / 4), micro-batches of 8


def test_the_image_rule_scales_the_learning_rate_by_how_far_a_black_and_a_white_image_lie_apart():
    """The image recipe's data-free scale s (dp_defaults.head_input_norm on `data_free_images`): the distance between
    the head inputs of a black and a white image as the model's preprocessing makes them, not the grey image's norm
    (most of which every image shares); with pixel values given, the grey image alone, as before."""
    import torch
    from transformers import ViTImageProcessor

    from hf_dp_repr.scripts.dp_defaults import choose, head_input_norm
    from hf_dp_repr.scripts.image_classification import data_free_images
    from hf_dp_repr.tiny import tiny_vit

    processor = ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pair = data_free_images(processor, 3, None)["pixel_values"]
    assert pair.shape == (2, 3, 8, 8) and torch.allclose(pair[0], torch.full((3, 8, 8), -1.0))
    assert torch.allclose(pair[1], torch.ones(3, 8, 8))
    model = tiny_vit(num_labels=3, num_channels=3).eval()
    with torch.no_grad():  # what the head reads: the final layer-normed [CLS] token
        cls = model.vit(pixel_values=pair).last_hidden_state[:, 0]
        grey_cls = model.vit(pixel_values=torch.zeros(1, 3, 8, 8)).last_hidden_state[0, 0]
    s = head_input_norm(model, {"pixel_values": pair})
    assert abs(s - float((cls[1] - cls[0]).norm())) < 1e-4
    grey = head_input_norm(model, data_free_images(None, 3, torch.zeros(3, 8, 8)))
    assert abs(grey - float(grey_cls.norm())) < 1e-4 and abs(s - grey) > 1e-3
    lr = choose(n=1000, epsilon=8.0, given=set(), feature_norm=s).values["learning_rate"]
    assert abs(lr - float(f"{0.9 * 8 / s:.3g}")) < 1e-9


# ---- public images for a pretrained model's probe (--public_dataset_name) ------------------------------------------
def _png_folder(root, n: int, seed: int, labelled: bool = True) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / ("ab"[i % 2] if labelled else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return str(root)


def _pretrained_vit(path) -> str:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    config = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64, num_labels=2)
    ViTForImageClassification(config).save_pretrained(path)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return str(path)


def test_public_images_standardise_the_probe_by_default_and_ship_folded_in_the_head(tmp_path, caplog):
    """With --public_dataset_name (unlabelled PNGs, disjoint from the user's) the defaults standardise the probe's
    input on them (probe_preconditioning) and take the learning rate's scale as √d; the statistics are fitted on the
    public rows alone, the saved head is plain and the card names them. Seen failing without the option (an unknown
    argument) and with the preconditioning left 'none' (the scale of the black/white images instead)."""
    import logging

    from transformers import AutoModelForImageClassification

    model = _pretrained_vit(tmp_path / "model")
    argv = ["--model_name_or_path", model, "--dataset_name", _png_folder(tmp_path / "mine", 40, seed=0),
            "--public_dataset_name", _png_folder(tmp_path / "public", 24, seed=1, labelled=False),
            "--target_epsilon", "8", "--target_delta", "1e-4", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--output_dir", str(tmp_path / "out")]
    with caplog.at_level(logging.INFO, logger="hf_dp_repr"):
        metrics = image_recipe.main(argv)
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "--probe_preconditioning standardize" in logs and "fitted on 24 public rows" in logs
    assert f"--learning_rate {float(f'{3 * 0.9 * 8 / 32 ** 0.5:.3g}'):g}" in logs  # 3 × 0.9·ε / √d, d = 32 inputs
    assert 0 < metrics["epsilon"] <= 8
    saved = AutoModelForImageClassification.from_pretrained(tmp_path / "out")
    assert type(saved.classifier).__name__ == "Linear"  # the preconditioning folded into a plain head
    card = (tmp_path / "out" / "README.md").read_text()
    assert "24 images of" in card and "labels unused" in card


def test_public_images_are_refused_where_they_cannot_be_public_or_used(tmp_path):
    """Before training: the user's own images given as public (shared rows), a random-init model (public images do
    not pre-train it), both public sources, a missing split or folder (before any work), and a scope that is not a
    probe (nothing to precondition)."""
    from hf_dp_repr.errors import DPConfigError

    mine, model = _png_folder(tmp_path / "mine", 40, seed=0), _pretrained_vit(tmp_path / "model")
    base = ["--dataset_name", mine, "--target_epsilon", "8", "--target_delta", "1e-4", "--report_to", "none",
            "--disable_tqdm", "true", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(DPConfigError, match="shares rows with the private training set"):
        image_recipe.main(base + ["--model_name_or_path", model, "--public_dataset_name", mine])
    public = _png_folder(tmp_path / "public", 8, seed=1, labelled=False)
    with pytest.raises(RecipeArgumentError, match="preconditions a pretrained model's linear probe"):
        image_recipe.main(base + ["--public_dataset_name", public])  # the default tiny ViT
    with pytest.raises(RecipeArgumentError, match="both give public data"):
        image_recipe.main(base + ["--model_name_or_path", model, "--public_dataset_name", public,
                                  "--public_fraction", "0.5"])
    with pytest.raises(RecipeArgumentError, match="has the splits"):
        image_recipe.main(base + ["--model_name_or_path", model, "--public_dataset_name", public,
                                  "--public_split", "validation"])
    from hf_dp_repr.errors import DataError

    with pytest.raises(DataError, match="--public_dataset_name"):
        image_recipe.main(base + ["--model_name_or_path", model, "--public_dataset_name", str(tmp_path / "none")])
    assert not (tmp_path / "out").exists()  # each refused before anything was written
    with pytest.raises(RecipeArgumentError, match="does not train"):
        image_recipe.main(base + ["--model_name_or_path", model, "--public_dataset_name", public,
                                  "--trainable_blocks", "1"])
