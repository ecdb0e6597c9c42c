"""--optimizer adam8bit in every parallel layout trains the single-process 8-bit model.

The same contract as test_layouts.py (dropout 0, global batch 8, losses within 1e-4 relative,
gradient norms within 1e-3), with 8-bit optimizer states: the data-parallel layouts cut the
flat buffers elsewhere (blocks follow the parameters), tensor parallelism holds shards (the
8-bit vs fp32 choice follows the whole parameter's size)."""

import pytest

from tests.parallel.launching import build_corpus
from tests.parallel.test_layouts import GLOBAL_BATCH, ITERS, LAYOUTS, assert_same_training, train

EIGHT_BIT = ("--optimizer", "adam8bit")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def single_process_8bit(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("single8"), (1, 1, GLOBAL_BATCH), ITERS,
                 *EIGHT_BIT)


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2xdp2"])
def test_8bit_layout_matches_single_process(corpus, single_process_8bit, tmp_path, name):
    metrics = train(corpus, tmp_path, LAYOUTS[name], ITERS, *EIGHT_BIT)
    assert_same_training(single_process_8bit, metrics, ITERS)
