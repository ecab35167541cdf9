import os

# Before anything imports torch (OpenMP reads its policy when it loads), datasets or huggingface_hub (they read
# the offline switches when imported): tests never reach the network, and OpenMP threads sleep instead of spinning
# at barriers on a shared machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import collections  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import make_token_dataset  # noqa: E402  (helpers shared by test files: tests/utils.py)


def pytest_collection_modifyitems(config, items):
    """The files with tests marked slow first, those with the most of them before the others (the order within a file
    and among the rest kept): `make test` hands whole files to 2 pytest-xdist workers in this order, so the long files
    start at once and the short ones fill in, instead of a long file picked up last keeping one worker busy alone."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


def pytest_collection_finish(session):
    """Every test module is imported now: move the objects that exist (modules, classes, functions: torch,
    transformers, datasets...) out of the garbage collector's reach. Each `Trainer.train` calls `gc.collect()`
    (accelerate's `free_memory`): a full scan of these ~460k objects took 0.3-2.4 s per run on the shared 2-core
    machine, to free nothing. Objects made later, by the tests, are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _each_test_is_a_process_of_its_own():
    """hf_dp_repr.training.hp_search.tuning_data remembers the private training sets of the process (a public-mode
    search on one is refused); tests reuse the same digits rows for unrelated scenarios."""
    yield
    from hf_dp_repr.training.hp_search.tuning_data import forget

    forget()


@pytest.fixture(autouse=True)
def _log_levels_restored():
    """DPTrainer (`log_level`, training/report.follow_log_level) and the recipes (`setup_logging`) set the level of
    the `hf_dp_repr` and root loggers for the whole process: a later test in the same process (a pytest-xdist worker
    runs many files) would inherit INFO, and with it the end-of-training line of attack rates, a privacy loss
    distribution that takes minutes for a σ of 0.01 (test_scope_groups' runs: 90-470 s a test)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("", "hf_dp_repr")]
    saved = [(log.level, log.handlers[:]) for log in loggers]
    yield
    for log, (level, handlers) in zip(loggers, saved):
        log.setLevel(level)
        log.handlers[:] = handlers


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test runs torch on one thread: the tests use tiny models, which gain nothing from intra-op threads, and 2
    OpenMP threads on a busy 2-core machine ran up to 100× slower (spinning barriers). A test that needs more threads
    asks for them (the `two_threads` fixture)."""
    torch.set_num_threads(1)
    yield


@pytest.fixture
def two_threads():
    """Opt out of `one_thread` for one test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hub_server():
    from hf_dp_repr.hub.local_server import LocalHub

    server = LocalHub().start()
    yield server
    server.stop()


@pytest.fixture
def hub(hub_server, monkeypatch, tmp_path_factory):
    """The local Hub (hub/local_server.py), empty, with the real huggingface_hub / transformers clients pointed at it
    for this test only: online, Xet off (every upload a regular one), a fresh download cache, logged in as `someone`
    with a write token (`monkeypatch.setenv("HF_TOKEN", ...)` to change who). Every other test stays offline."""
    from huggingface_hub import constants, hf_api
    from transformers.utils import hub as transformers_hub

    hub_server.reset()
    home = tmp_path_factory.mktemp("hf_home")
    for name, value in [("ENDPOINT", hub_server.url), ("HF_HUB_OFFLINE", False), ("HF_HUB_DISABLE_XET", True),
                        ("HF_HUB_DISABLE_TELEMETRY", True), ("HF_HUB_CACHE", str(home / "hub")),
                        ("HF_TOKEN_PATH", str(home / "token")), ("HF_STORED_TOKENS_PATH", str(home / "stored_tokens")),
                        ("HUGGINGFACE_CO_URL_TEMPLATE", hub_server.url + "/{repo_id}/resolve/{revision}/{filename}")]:
        monkeypatch.setattr(constants, name, value)  # read by the client at call time
    monkeypatch.setattr(hf_api.api, "endpoint", hub_server.url)  # instances made at import time
    monkeypatch.setattr(transformers_hub, "_hf_api", None)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_write_someone")
    yield hub_server
    assert not hub_server.unknown, f"requests the test Hub does not serve: {hub_server.unknown}"


@pytest.fixture(scope="session")
def digits():
    from hf_dp_repr.data import load_digits_dataset

    return load_digits_dataset()


@pytest.fixture
def token_dataset():
    return make_token_dataset()


@pytest.fixture
def no_pretraining(monkeypatch):
    """The recipes' public pre-training fails the test: bad arguments must be refused before it starts."""
    from hf_dp_repr.scripts import utils as ru

    def refuse(*args, **kwargs):
        raise AssertionError("public pre-training started before the arguments were checked")

    monkeypatch.setattr(ru, "pretrain_on_public", refuse)
