"""Data order for pretraining: one global sample order, sliced into per-rank micro batches."""

import os
import signal

import numpy as np
import torch

from megatron.errors import DataError


class PretrainingSampler:
    """Yields this data-parallel rank's micro batches as lists of sample indices.

    Samples consumed_samples, consumed_samples+1, ... are cut into consecutive chunks of
    micro_batch_size * data_parallel_size; rank r takes slice [r*mbs, (r+1)*mbs) of each.
    The order depends only on the global sample sequence, so resuming with the
    consumed_samples from a checkpoint continues exactly, for any data-parallel size.
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, drop_last=True):
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in "
                             f"[0, {data_parallel_size})")
        if total_samples < 1:
            raise DataError("the dataset has no samples to train on; check --split and the "
                            "number of iterations")
        if not 0 <= consumed_samples <= total_samples:
            raise DataError(f"cannot resume at consumed samples {consumed_samples}: the dataset "
                            f"was built for {total_samples} samples. Resume with a run at least "
                            "as long as the checkpoint's (--train-iters × --global-batch-size, "
                            "or --train-samples)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_chunk = micro_batch_size * data_parallel_size
        self.rank_start = data_parallel_rank * micro_batch_size
        self.drop_last = drop_last

    def __len__(self):
        remaining = self.total_samples - self.consumed_samples
        full, tail = divmod(remaining, self.global_chunk)
        has_tail_batch = not self.drop_last and tail > self.rank_start
        return full + int(has_tail_batch)

    def __iter__(self):
        chunk_start = self.consumed_samples
        while chunk_start + self.global_chunk <= self.total_samples:
            first = chunk_start + self.rank_start
            yield list(range(first, first + self.micro_batch_size))
            chunk_start += self.global_chunk
        # The incomplete last chunk: ranks whose slice is empty yield nothing more.
        first = chunk_start + self.rank_start
        if not self.drop_last and first < self.total_samples:
            yield list(range(first, min(first + self.micro_batch_size, self.total_samples)))


def collate_text(samples):
    """[{"text": int64 [s+1]}] * b -> {"text": LongTensor [b, s+1]}."""
    return {"text": torch.from_numpy(np.stack([sample["text"] for sample in samples]))}


def _check_worker_count(num_workers):
    """Each loader worker is a forked process: thousands of them swamp the machine for minutes
    before anything trains (--num-workers 10000 on 2 cores hung)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = 4 * (cpus or 1)
    if num_workers > limit:
        raise DataError(f"--num-workers {num_workers} starts that many loader processes per "
                        f"rank, on {cpus} CPU(s) here; use at most {limit} (1-4 are plenty: "
                        "reading tokens from the memory-mapped .bin is cheap)")


def build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                  data_parallel_rank, data_parallel_size, num_workers,
                                  drop_last=True):
    """DataLoader over `dataset` yielding {"text": LongTensor [b, seq+1]} for this DP rank."""
    if dataset is None:
        return None
    _check_worker_count(num_workers)
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size, drop_last)
    # A private generator: creating an iterator draws a worker base seed, which must not
    # come from (and shift) the global torch RNG that dropout uses -- exact resume needs it.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_text,
                                       worker_init_fn=_ignore_ctrl_c,
                                       pin_memory=torch.cuda.is_available(),
                                       generator=torch.Generator().manual_seed(0))


def _ignore_ctrl_c(worker_id):
    """Loader workers leave Ctrl-C to the trainer, which stops at an iteration boundary (a
    worker ended by it would fail the next batch instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
