"""Processes launched together form one DP run, or are refused: never several runs on the same data, each with its
own secret noise, its own save and push, and a ledger stating the ε of one of them."""

import os

import pytest

from hf_dp_repr.errors import ProcessGroupError
from hf_dp_repr.training.arguments.checks import check_one_run, join_cpu_processes, launched_processes


@pytest.fixture
def launcher_env(monkeypatch):
    """A clean launcher environment (restored after the test)."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_processes_that_a_launcher_started_together_must_form_one_world(launcher_env):
    assert launched_processes() == 1
    check_one_run(1)  # a process started alone
    launcher_env.setenv("WORLD_SIZE", "2")
    assert launched_processes() == 2
    check_one_run(2)
    with pytest.raises(ProcessGroupError, match=r"2 processes were launched together \(WORLD_SIZE=2\).*"
                                                r"ACCELERATE_USE_CPU=true") as err:
        check_one_run(1)
    assert isinstance(err.value, RuntimeError)
    launcher_env.setenv("WORLD_SIZE", "1")
    launcher_env.setenv("OMPI_COMM_WORLD_SIZE", "4")  # mpirun
    with pytest.raises(ProcessGroupError, match="OMPI_COMM_WORLD_SIZE=4"):
        check_one_run(1)


def test_cpu_processes_are_joined_and_a_world_that_stays_split_is_refused_before_any_work(launcher_env, tmp_path):
    join_cpu_processes()  # one process: nothing to join
    assert "ACCELERATE_USE_CPU" not in os.environ
    launcher_env.setenv("WORLD_SIZE", "2")
    join_cpu_processes()  # no GPU here: accelerate is told to use CPU (gloo)
    assert os.environ["ACCELERATE_USE_CPU"] == "true"
    # A user who turned that off (or set up accelerate otherwise) gets a world of 1: refused by the arguments.
    launcher_env.setenv("ACCELERATE_USE_CPU", "false")
    from hf_dp_repr import DPTrainingArguments

    with pytest.raises(ProcessGroupError, match="the Trainer sees a world of 1"):
        DPTrainingArguments(output_dir=str(tmp_path / "out"), target_epsilon=1.0, report_to="none")
    assert not (tmp_path / "out").exists()


# A user's own script under `accelerate launch` is one run: tests/test_ddp.py (it shares that file's launch).
