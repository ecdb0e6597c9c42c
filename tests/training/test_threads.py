"""CPU threads per process: --threads, else $OMP_NUM_THREADS, else cores / local ranks."""

import os

import pytest

from megatron.errors import ConfigError
from megatron.runtime.device import default_num_threads


def test_omp_num_threads_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_num_threads() == 3


def test_without_it_the_cores_are_shared_among_local_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_num_threads() == max(1, (os.cpu_count() or 1) // 2)


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_value_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS='{value}' is not a positive number"):
        default_num_threads()


def test_the_trainer_uses_it(monkeypatch, tmp_path):
    """pretrain's set-up sets torch's thread count from it when --threads is absent."""
    import torch

    from megatron.config import resolve_config
    from megatron.runtime.initialize import destroy, initialize_megatron
    wanted = (os.cpu_count() or 1) + 1  # never what the default would pick
    monkeypatch.setenv("OMP_NUM_THREADS", str(wanted))
    before = torch.get_num_threads()
    config = resolve_config(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads",
                             "1", "--seq-length", "4", "--batch-size", "1", "--train-iters", "1",
                             "--lr", "1e-3", "--data-path", "x", "--tokenizer-type",
                             "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"],
                            world_size=1)
    try:
        initialize_megatron(config.parallel)
        assert torch.get_num_threads() == wanted
    finally:
        destroy()
        torch.set_num_threads(before)
