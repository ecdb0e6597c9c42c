import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread avoids spin-waiting beside other jobs on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
