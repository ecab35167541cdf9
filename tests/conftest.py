import os

# Before anything imports torch (OpenMP reads its policy when it loads), datasets or huggingface_hub (they read
# the offline switches when imported): tests never reach the network, and OpenMP threads sleep instead of spinning
# at barriers on a shared machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import make_token_dataset  # noqa: E402  (helpers shared by test files: tests/utils.py)

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _each_test_is_a_process_of_its_own():
    """hf_dp_repr.tuning.tuning_data remembers the private training sets of the process (a public-mode search on one
    is refused); tests reuse the same digits rows for unrelated scenarios."""
    yield
    from hf_dp_repr.tuning.tuning_data import forget

    forget()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and 2 OpenMP threads on a busy 2-core machine ran up to 100×
    slower (spinning barriers): modules of tiny-model tests use one (`pytestmark = pytest.mark.usefixtures(...)`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def digits():
    from hf_dp_repr.data import load_digits_dataset

    return load_digits_dataset()


@pytest.fixture
def token_dataset():
    return make_token_dataset()
