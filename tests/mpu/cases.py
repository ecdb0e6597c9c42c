"""Worker side of the distributed mpu tests.

One gloo job of 4 processes runs every case below at tensor-parallel sizes 4, 2 and 1 (the
groups are rebuilt in between, which also exercises teardown).  Each case returns plain
tensors; the tests in this folder compare them with single-process reference math.
"""

import io
import traceback

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.errors import ConfigError
from megatron.mpu import layers as layers_mod


def det(*shape, seed, scale=1.0):
    """A tensor that parent and workers can regenerate from `seed` alone."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def det_ints(*shape, high, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def shard(full, dim, tp, rank):
    size = full.size(dim) // tp
    return full.narrow(dim, rank * size, size)


def case_layout(rank, tp):
    return dict(
        tp_rank=mpu.get_model_parallel_rank(), tp_size=mpu.get_model_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
        src_rank=mpu.get_model_parallel_src_rank(),
        tp_group=dist.get_process_group_ranks(mpu.get_model_parallel_group()),
        dp_group=dist.get_process_group_ranks(mpu.get_data_parallel_group()))


def case_mappings(rank, tp):
    r = mpu.get_model_parallel_rank()
    out = {}
    x = det(4, 8, seed=1).requires_grad_()
    y = mpu.copy_to_model_parallel_region(x)
    y.backward(det(4, 8, seed=100 + r))
    out["copy"] = (y.detach(), x.grad)

    x = det(4, 8, seed=200 + r).requires_grad_()
    y = mpu.reduce_from_model_parallel_region(x.clone())
    y.backward(det(4, 8, seed=2))
    out["reduce"] = (y.detach(), x.grad)

    x = det(4, 8, seed=3).requires_grad_()
    y = mpu.scatter_to_model_parallel_region(x)
    y.backward(det(4, 8 // tp, seed=300 + r))
    out["scatter"] = (y.detach(), x.grad)

    x = det(4, 8 // tp, seed=400 + r).requires_grad_()
    y = mpu.gather_from_model_parallel_region(x)
    y.backward(det(4, 8, seed=4))
    out["gather"] = (y.detach(), x.grad)
    return out


def _set_bias(layer, full_bias, parallel, tp, rank):
    with torch.no_grad():
        layer.bias.copy_(shard(full_bias, 0, tp, rank) if parallel else full_bias)


def _tags(param):
    return (getattr(param, "model_parallel", None), getattr(param, "partition_dim", None),
            getattr(param, "partition_stride", None))


def case_column(rank, tp):
    r = mpu.get_model_parallel_rank()
    out = {}
    for gather in (True, False):
        torch.manual_seed(10)
        layer = mpu.ColumnParallelLinear(6, 8, gather_output=gather)
        _set_bias(layer, det(8, seed=13), True, tp, r)
        x = det(3, 2, 6, seed=11).requires_grad_()
        y, bias = layer(x)
        grad = det(3, 2, 8, seed=12)
        y.backward(grad if gather else shard(grad, 2, tp, r))
        out[gather] = dict(weight=layer.weight.detach(), y=y.detach(), bias_out=bias,
                           x_grad=x.grad, w_grad=layer.weight.grad, b_grad=layer.bias.grad,
                           tags=(_tags(layer.weight), _tags(layer.bias)))
    layer = mpu.ColumnParallelLinear(6, 8, gather_output=False, skip_bias_add=True)
    _set_bias(layer, det(8, seed=13), True, tp, r)
    y, bias = layer(det(3, 2, 6, seed=11))
    out["skip"] = dict(weight=layer.weight.detach(), y=y.detach(), bias_out=bias.detach())
    return out


def case_row(rank, tp):
    r = mpu.get_model_parallel_rank()
    out = {}
    for parallel_input in (False, True):
        torch.manual_seed(20)
        layer = mpu.RowParallelLinear(8, 6, input_is_parallel=parallel_input)
        _set_bias(layer, det(6, seed=23), False, tp, r)
        full_x = det(3, 2, 8, seed=21)
        x = (shard(full_x, 2, tp, r) if parallel_input else full_x).clone().requires_grad_()
        y, bias = layer(x)
        y.backward(det(3, 2, 6, seed=22))
        out[parallel_input] = dict(weight=layer.weight.detach(), y=y.detach(), bias_out=bias,
                                   x_grad=x.grad, w_grad=layer.weight.grad,
                                   b_grad=layer.bias.grad,
                                   tags=(_tags(layer.weight), _tags(layer.bias)))
    layer = mpu.RowParallelLinear(8, 6, skip_bias_add=True)
    _set_bias(layer, det(6, seed=23), False, tp, r)
    y, bias = layer(det(3, 2, 8, seed=21))
    out["skip"] = dict(weight=layer.weight.detach(), y=y.detach(), bias_out=bias.detach())
    return out


def case_embedding(rank, tp):
    torch.manual_seed(30)
    layer = mpu.VocabParallelEmbedding(16, 4)
    ids = torch.tensor([[0, 3, 4, 7], [8, 11, 12, 15], [15, 0, 5, 5]])
    y = layer(ids)
    y.backward(det(3, 4, 4, seed=31))
    return dict(weight=layer.weight.detach(), y=y.detach(), w_grad=layer.weight.grad,
                tags=_tags(layer.weight))


def build_init_layers():
    """Layers whose weights the init test compares with the single-process ones."""
    saved = layers_mod._INIT_CHUNK_ELEMENTS
    layers_mod._INIT_CHUNK_ELEMENTS = 40  # several chunks per weight, cut mid-shard
    try:
        torch.manual_seed(40)
        built = dict(qkv=mpu.ColumnParallelLinear(12, 24, stride=3),
                     column=mpu.ColumnParallelLinear(5, 8),
                     row=mpu.RowParallelLinear(12, 8),
                     row_strided=mpu.RowParallelLinear(16, 6, stride=2),
                     embedding=mpu.VocabParallelEmbedding(16, 6))
        after = torch.rand(3)  # the generator must have advanced identically everywhere
    finally:
        layers_mod._INIT_CHUNK_ELEMENTS = saved
    return {name: layer.weight.detach() for name, layer in built.items()}, after


def case_init(rank, tp):
    return build_init_layers()


def case_cross_entropy(rank, tp, function=None):
    r = mpu.get_model_parallel_rank()
    full = det(2, 3, 16, seed=50, scale=3.0)
    logits = shard(full, 2, tp, r).clone().requires_grad_()
    before = logits.detach().clone()
    target = torch.tensor([[0, 5, 15], [8, 4, 12]])  # ids in every quarter of the vocab
    loss = function.apply(logits, target) if function else \
        mpu.vocab_parallel_cross_entropy(logits, target)
    unchanged = torch.equal(logits.detach(), before)
    loss.backward(det(2, 3, seed=51))
    return dict(loss=loss.detach(), grad=logits.grad, unchanged=unchanged)


def case_chunked_cross_entropy(rank, tp):
    """The chunked form (16-bit logits on the CPU take it), here on the fp32 logits of the
    case above and with one row per chunk, so each rank's max and sums cross chunks."""
    from megatron.mpu import cross_entropy
    chunk = cross_entropy._CPU_CHUNK_ELEMENTS
    cross_entropy._CPU_CHUNK_ELEMENTS = 1
    try:
        return case_cross_entropy(rank, tp, cross_entropy._ChunkedVocabParallelCrossEntropy)
    finally:
        cross_entropy._CPU_CHUNK_ELEMENTS = chunk


def case_broadcast(rank, tp):
    dp = mpu.get_data_parallel_rank()
    data = None
    if mpu.get_model_parallel_rank() == 0:
        data = {"text": det_ints(2, 5, high=100, seed=60 + dp),
                "other": det_ints(3, high=100, seed=70 + dp),
                "cube": det_ints(2, 1, 2, 3, high=100, seed=80 + dp)}
    return mpu.broadcast_data(["text", "other", "cube"], data, torch.int64)


def case_grads(rank, tp):
    """Column -> GeLU -> Row -> LayerNorm; norms before clipping and clipped grads."""
    r = mpu.get_model_parallel_rank()
    torch.manual_seed(90)
    column = mpu.ColumnParallelLinear(6, 8, gather_output=False)
    row = mpu.RowParallelLinear(8, 6, input_is_parallel=True)
    norm = torch.nn.LayerNorm(6)
    _set_bias(column, det(8, seed=91), True, tp, r)
    _set_bias(row, det(6, seed=92), False, tp, r)
    with torch.no_grad():
        norm.weight.copy_(det(6, seed=93))
    hidden, _ = column(det(5, 6, seed=94))
    out, _ = row(torch.nn.functional.gelu(hidden))
    (norm(out) * det(5, 6, seed=95)).sum().backward()
    params = [column.weight, column.bias, row.weight, row.bias, norm.weight, norm.bias]
    norms = dict(l2=mpu.get_grad_norm(params), inf=mpu.get_grad_norm(params, float("inf")),
                 l1=mpu.get_grad_norm(params, 1))
    returned = mpu.clip_grad_norm(params, max_norm=0.5)
    return dict(weights=[p.detach() for p in params[:4]], norms=norms, returned=returned,
                clipped=[p.grad for p in params])


def case_seed(rank, tp):
    mpu.model_parallel_cuda_manual_seed(1234)
    with mpu.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return dict(default=torch.rand(3), tracked=tracked)


def case_bad_size(rank, tp):
    try:
        mpu.initialize_model_parallel(3)
    except ConfigError as error:
        return str(error)
    return None


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_plan(rank, world_size, plan):
    """For (tp, case names) in plan: build groups, run the cases, tear the groups down.

    Returns the serialised {(tp, case name): result} (see `to_bytes`).
    A failing case is reported as ("error", traceback) rather than ending the job, so one
    broken piece fails only its own tests.
    """
    results = {}
    for tp, names in plan:
        mpu.initialize_model_parallel(tp)
        for name in names:
            try:
                results[(tp, name)] = CASES[name](rank, tp)
            except Exception:
                results[(tp, name)] = ("error", traceback.format_exc())
        mpu.destroy_model_parallel()
    return to_bytes(results)


def to_bytes(obj):
    """Serialise tensors for the trip to the parent.

    Tensors put on a multiprocessing queue travel as shared-memory handles that die with
    the worker process, so results cross as plain bytes instead.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data):
    return torch.load(io.BytesIO(data), weights_only=False)
