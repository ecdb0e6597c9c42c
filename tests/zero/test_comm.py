"""zero/comm/communicator.py on gloo: the ring reduce-scatter against the all-reduce path, the point-to-point all-gather
and the point-to-point reduce against exact sums, byte accounting."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.comm.communicator import Communicator

N = 4 * 1000 + 16  # a multiple of 2 and 4 ranks


def _rank_input(rank):
    return torch.randn(N, generator=torch.Generator().manual_seed(100 + rank))


def _reduce_scatters(rank, world_size):
    ring, via_all_reduce = Communicator(), Communicator(reduce_scatter_impl="all_reduce")
    n = N // world_size
    x = _rank_input(rank)
    out_ring, out_all_reduce = torch.empty(n), torch.empty(n)
    ring.reduce_scatter(out_ring, x.clone())
    via_all_reduce.reduce_scatter(out_all_reduce, x.clone())
    # several async calls in flight at once, finished in launch order (as stage 2/3 do)
    inputs = [x.clone() * (i + 1) for i in range(3)]
    outs = [torch.empty(n) for _ in inputs]
    pendings = [ring.reduce_scatter(o, i, async_op=True) for o, i in zip(outs, inputs)]
    for pending in pendings:
        pending.wait()
    # in place: the output is this rank's chunk of the input
    in_place = x.clone()
    ring.reduce_scatter(in_place.narrow(0, rank * n, n), in_place)
    sent = ring.stats.sent_bytes("reduce_scatter")
    return {"ring": out_ring, "all_reduce": out_all_reduce, "async": outs,
            "in_place": in_place.narrow(0, rank * n, n).clone(), "sent": sent,
            "calls": ring.stats.calls("reduce_scatter"),
            "all_reduce_sent": via_all_reduce.stats.sent_bytes("all_reduce")}


@pytest.fixture(scope="module", params=[2, 4])
def reduce_scatter_results(request):
    world = request.param
    return world, run_distributed(_reduce_scatters, world_size=world)


def test_ring_reduce_scatter_sums_each_chunk_on_its_owner(reduce_scatter_results):
    world, results = reduce_scatter_results
    total = sum(_rank_input(r).double() for r in range(world))
    n = N // world
    for rank, result in enumerate(results):
        expected = total.narrow(0, rank * n, n).float()
        torch.testing.assert_close(result["ring"], expected, rtol=1e-6, atol=1e-6)
        for i, out in enumerate(result["async"]):
            torch.testing.assert_close(out, expected * (i + 1), rtol=1e-6, atol=1e-5)
        assert torch.equal(result["in_place"], result["ring"])


def test_ring_matches_all_reduce_path_bit_for_bit_at_two_ranks(reduce_scatter_results):
    world, results = reduce_scatter_results
    for result in results:
        if world == 2:  # one addition a + b per element: the same in both
            assert torch.equal(result["ring"], result["all_reduce"])
        else:  # a different summation order: fp32 rounding
            torch.testing.assert_close(result["ring"], result["all_reduce"], rtol=1e-6,
                                       atol=1e-6)


def test_ring_sends_n_minus_one_over_n_of_the_buffer(reduce_scatter_results):
    world, results = reduce_scatter_results
    for result in results:
        one_call = (world - 1) / world * N * 4
        assert result["calls"] == 5
        assert result["sent"] == pytest.approx(5 * one_call)
        assert result["all_reduce_sent"] == pytest.approx(2 * one_call)  # twice the ring


def _gathers_and_reduces(rank, world_size):
    import zero.comm.ring
    zero.comm.ring.PIECE_NUMEL = 300  # several pieces per message, and a short last piece
    comm = Communicator()
    n = N // world_size
    x = _rank_input(rank)
    own = x.narrow(0, 0, n)
    gathered = torch.full((N,), float("nan"))
    comm.all_gather(gathered, own.clone())  # from a separate input
    in_place = torch.full((N,), float("nan"))
    in_place.narrow(0, rank * n, n).copy_(own)
    comm.all_gather(in_place, in_place.narrow(0, rank * n, n))
    outs = [torch.full((N,), float("nan")) for _ in range(3)]  # several in flight
    pendings = [comm.all_gather(o, own * (i + 1), async_op=True) for i, o in enumerate(outs)]
    for pending in pendings:
        pending.wait()
    reduced = []
    for dst in range(world_size):  # async, all in flight, finished in order
        tensors = [x.clone() * (dst + 1) for _ in range(2)]
        pendings = [comm.reduce(t, dst, async_op=True) for t in tensors]
        for pending in pendings:
            pending.wait()
        reduced.append(tensors)
    return {"gathered": gathered, "in_place": in_place, "async": outs, "reduced": reduced,
            "reduce_sent": comm.stats.sent_bytes("reduce"),
            "gather_sent": comm.stats.sent_bytes("all_gather")}


@pytest.mark.parametrize("world", [2, 4])
def test_point_to_point_all_gather_and_reduce(world):
    results = run_distributed(_gathers_and_reduces, world_size=world)
    n = N // world
    expected = torch.cat([_rank_input(r).narrow(0, 0, n) for r in range(world)])
    total = sum(_rank_input(r) for r in range(world))  # the owner adds in rank order
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], expected)
        assert torch.equal(result["in_place"], expected)
        for i, out in enumerate(result["async"]):
            assert torch.equal(out, torch.cat([(_rank_input(r).narrow(0, 0, n) * (i + 1))
                                               for r in range(world)]))
        for dst, tensors in enumerate(result["reduced"]):
            mine = _rank_input(rank) * (dst + 1)
            for tensor in tensors:
                if rank == dst:
                    torch.testing.assert_close(tensor, total * (dst + 1), rtol=1e-6, atol=1e-5)
                else:  # a non-owner's tensor is left as it was
                    assert torch.equal(tensor, mine)
        assert result["reduce_sent"] == 2 * (world - 1) * N * 4  # sends to every other owner
        assert result["gather_sent"] == pytest.approx(5 * (world - 1) / world * N * 4)


def test_bad_reduce_scatter_impl_is_rejected():
    with pytest.raises(ValueError, match="reduce_scatter_impl"):
        Communicator(reduce_scatter_impl="tree")


def _stage1_fp32_master(rank, world_size):
    engine = cases.make_engine(cases.ds_config(1, global_batch_size=8 * world_size, gas=1))
    cases.train_steps(engine, 1)
    group = engine.optimizer.groups[0]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    return (storage(group.master) == storage(group.flat),
            storage(group.master.grad) == storage(group.full_grads), group.layout.num_buckets)


def test_stage1_fp32_master_and_its_grad_are_views_of_the_flat_buffers():
    for master_in_flat, grad_in_full_grads, buckets in run_distributed(_stage1_fp32_master, 2):
        assert master_in_flat and grad_in_full_grads and buckets == 1
