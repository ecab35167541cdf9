"""RepresentationLawCallback inside a short plain transformers Trainer run."""

import json
import warnings

import pytest
from transformers import PrinterCallback, Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_dp_repr.analysis import RepresentationLawCallback
from hf_dp_repr.data import load_digits_dataset
from hf_dp_repr.tiny import tiny_vit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def digits_ds():
    return load_digits_dataset()


def make_trainer(tmp_path, digits_ds, **arg_overrides):
    kwargs = dict(max_steps=6, eval_strategy="steps", eval_steps=3, logging_steps=3, learning_rate=3e-3,
                  per_device_train_batch_size=32, per_device_eval_batch_size=64, report_to="none",
                  use_cpu=True, disable_tqdm=True, save_strategy="no")
    kwargs.update(arg_overrides)
    args = TrainingArguments(str(tmp_path), **kwargs)
    trainer = Trainer(model=tiny_vit(), args=args, train_dataset=digits_ds["train"].select(range(256)),
                      eval_dataset=digits_ds["test"])
    trainer.remove_callback(PrinterCallback)
    return trainer


def test_logs_metrics_and_writes_json_and_png(tmp_path, digits_ds):
    trainer = make_trainer(tmp_path, digits_ds)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # analysing the eval set must not warn
        trainer.add_callback(RepresentationLawCallback(trainer=trainer, max_examples=200))
        trainer.train()

    logged = [e for e in trainer.state.log_history if "repr/fuzziness/rho" in e]
    assert [e["step"] for e in logged] == [0, 3, 6]  # train start, two evaluations; the end is step 6 again
    for entry in logged:
        assert {f"repr/fuzziness/layer_{i:02d}" for i in range(5)} <= entry.keys()
        assert {f"repr/residual/layer_{i:02d}" for i in range(5)} <= entry.keys()
        assert {"repr/fuzziness/r", "repr/residual/rho", "repr/residual/r"} <= entry.keys()
        assert all(entry[f"repr/fuzziness/layer_{i:02d}"] > 0 for i in range(5))

    saved = json.loads((tmp_path / "representation_law.json").read_text())
    analyses = saved["analyses"]
    assert [a["event"] for a in analyses] == ["train_begin", "evaluate", "evaluate"]
    assert [a["step"] for a in analyses] == [0, 3, 6]
    for a in analyses:
        assert a["num_examples"] == 200 and len(a["fuzziness"]) == len(a["residual"]) == 5
        assert 0 < a["fuzziness_law"]["rho"] and a["fuzziness_law"]["layers"] == [0, 1, 2, 3, 4]
        assert a["residual_law"]["layers"] == [1, 2, 3, 4]
        assert all(0 <= v <= 1 for v in a["residual"])
    assert analyses[-1]["fuzziness"] != analyses[0]["fuzziness"]  # the model trained in between
    assert logged[-1]["repr/fuzziness/layer_04"] == pytest.approx(analyses[-1]["fuzziness"][4])

    png = (tmp_path / "representation_law.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


@pytest.mark.parametrize("same", ["object", "fingerprint"])
def test_warns_when_analysing_the_training_set(tmp_path, digits_ds, same, caplog):
    trainer = make_trainer(tmp_path, digits_ds, max_steps=1, eval_strategy="no")
    analysis = trainer.train_dataset if same == "object" else load_digits_dataset()["train"].select(range(256))
    assert analysis is not trainer.train_dataset or same == "object"
    trainer.add_callback(RepresentationLawCallback(analysis, trainer=trainer, max_examples=100))
    with pytest.warns(UserWarning, match="TRAINING set"):
        trainer.train()
    assert "privacy accountant" in caplog.text


def test_without_a_trainer_metrics_still_reach_log_history(tmp_path, digits_ds):
    trainer = make_trainer(tmp_path, digits_ds, max_steps=2, eval_strategy="no")
    trainer.add_callback(RepresentationLawCallback(digits_ds["test"], max_examples=100))
    with pytest.warns(UserWarning, match="no trainer attached"):
        trainer.train()
    assert sum("repr/residual/rho" in e for e in trainer.state.log_history) == 2  # start and end


def test_only_the_main_process_writes_files(tmp_path, digits_ds):
    callback = RepresentationLawCallback(digits_ds["test"], max_examples=100)
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True)
    state = TrainerState(is_world_process_zero=False)
    with pytest.warns(UserWarning, match="no trainer attached"):
        callback.on_train_begin(args, state, TrainerControl(), model=tiny_vit())
    assert len(callback.history) == 1 and any("repr/" in k for k in state.log_history[0])
    assert not (tmp_path / "representation_law.json").exists()
    assert not (tmp_path / "representation_law.png").exists()


def test_needs_something_to_analyse(tmp_path, digits_ds):
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = Trainer(model=tiny_vit(), args=args, train_dataset=digits_ds["train"])
    trainer.add_callback(RepresentationLawCallback(trainer=trainer))
    with pytest.raises(ValueError, match="pass `analysis_dataset=`"):
        trainer.train()


def test_tensorboard_receives_per_layer_values_and_rho_at_each_evaluation(tmp_path, digits_ds):
    """report_to="tensorboard": the event file holds D_l, PR_l per layer and both ρ at train start and at every
    evaluation step, with the values of representation_law.json."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(tmp_path, digits_ds, report_to="tensorboard")
    trainer.add_callback(RepresentationLawCallback(trainer=trainer, max_examples=200))
    trainer.train()

    events = EventAccumulator(str(next(p.parent for p in tmp_path.rglob("events.out.tfevents.*")))).Reload()
    tags = set(events.Tags()["scalars"])
    analyses = json.loads((tmp_path / "representation_law.json").read_text())["analyses"]
    for name in ("fuzziness", "residual"):
        for layer in range(5):
            tag = f"train/repr/{name}/layer_{layer:02d}"  # transformers' rewrite_logs: all but eval_* get train/
            assert tag in tags, " ".join(sorted(tags))
            written = {e.step: e.value for e in events.Scalars(tag)}
            assert sorted(written) == [0, 3, 6]  # train start and the two evaluations
            for a in analyses:
                assert written[a["step"]] == pytest.approx(a[name][layer], rel=1e-5)  # float32 on disk
        rho = {e.step: e.value for e in events.Scalars(f"train/repr/{name}/rho")}
        assert rho[6] == pytest.approx(analyses[-1][f"{name}_law"]["rho"], rel=1e-5)
