import pytest

from tests.parallel.launching import build_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Synthetic text, a 512-token BPE and its .bin/.idx (tests/parallel/launching.py)."""
    return build_corpus(tmp_path_factory.mktemp("reliability_data"))
