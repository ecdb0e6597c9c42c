import pytest
import torch

from tests.dist_utils import run_distributed
from tests.mpu import cases

WORLD_SIZE = 4
# Tensor-parallel sizes 4 and 2 (two groups of 2: data parallel 2), then 1 (data parallel 4).
PLAN = [
    (4, ["layout", "mappings", "column", "row", "embedding", "init", "cross_entropy",
         "chunked_cross_entropy", "broadcast", "grads", "seed", "bad_size"]),
    (2, ["layout", "mappings", "column", "row", "embedding", "init", "cross_entropy",
         "chunked_cross_entropy", "broadcast", "grads", "seed"]),
    (1, ["layout", "mappings", "column", "row", "cross_entropy", "chunked_cross_entropy",
         "broadcast", "grads"]),
]


class DistributedResults:
    def __init__(self, per_rank):
        self.per_rank = per_rank  # list indexed by global rank of {(tp, case): result}

    def get(self, tp, case):
        """[result of global rank 0, 1, ...] for one case at one tensor-parallel size."""
        results = [ranked[(tp, case)] for ranked in self.per_rank]
        for rank, result in enumerate(results):
            if isinstance(result, tuple) and len(result) == 2 and result[0] == "error":
                pytest.fail(f"case {case!r} at tp={tp} failed on rank {rank}:\n{result[1]}")
        return results


@pytest.fixture(scope="session")
def dist_results():
    """Every distributed mpu case, run once in one 4-process gloo job."""
    per_rank = run_distributed(cases.run_plan, WORLD_SIZE, args=(PLAN,))
    return DistributedResults([cases.from_bytes(data) for data in per_rank])


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids spin-waiting beside other jobs on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
