"""The loader `zero.initialize(training_data=...)` returns: micro batches of the dataset, each
data-parallel rank its own share (DeepSpeed's `deepspeed_io`)."""

import torch

from zero.errors import ZeroError


def micro_batch_loader(training_data, collate_fn, micro_batch, drop_last, dp_world_size,
                       dp_rank):
    """A DataLoader of `micro_batch`-sized batches of this rank's share, or None without data."""
    if training_data is None:
        return None
    if isinstance(training_data, torch.utils.data.IterableDataset):
        if dp_world_size > 1:
            raise ZeroError("zero.initialize: training_data is an IterableDataset, which no "
                            f"sampler can share out over {dp_world_size} data-parallel ranks; "
                            "let each rank iterate its own share in a DataLoader of its own "
                            "and leave training_data out")
        sampler = None
    else:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=dp_world_size,
                                                      rank=dp_rank)
    return torch.utils.data.DataLoader(training_data, batch_size=micro_batch, sampler=sampler,
                                       collate_fn=collate_fn, drop_last=drop_last)
