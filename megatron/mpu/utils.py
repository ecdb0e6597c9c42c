"""Small arithmetic helpers shared by the tensor-parallel layers."""

import torch


def ensure_divisibility(numerator, denominator):
    """Assert that numerator is divisible by denominator."""
    assert numerator % denominator == 0, (
        f"{numerator} is not divisible by {denominator}")


def divide(numerator, denominator):
    """numerator / denominator as an int, asserting that it divides exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(tensor, num_partitions, contiguous_split_chunks=False):
    """Split `tensor` into `num_partitions` equal views along its last dimension."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """The contiguous vocabulary range [first, last) owned by one tensor-parallel rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition_vocab_size, rank, world_size)
