"""Data-parallel gradient synchronisation (megatron/distributed.py) against one process.

Every gloo run computes gradients of one global batch split over data-parallel ranks (and
micro batches); the reference is the same model in the test process on the whole batch.
"""

import io
import json
import os

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt2
from megatron import mpu
from megatron.arguments import parse_args
from megatron.distributed import COMM_STATS, wrap_data_parallel
from megatron.errors import ConfigError
from megatron.model import GPT2Model, GPTConfig, get_ltor_masks_and_position_ids
from tests.dist_utils import free_port, run_distributed
from tests.training.conftest import corpus  # noqa: F401  (the fixture)

SEQ, GLOBAL_BATCH, EOD = 8, 8, 0


def _config(checkpoint_activations=False):
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                     checkpoint_activations=checkpoint_activations)


def _build_model(dtype=torch.float32, checkpoint_activations=False):
    torch.manual_seed(11)
    mpu.model_parallel_cuda_manual_seed(11)
    return GPT2Model(_config(checkpoint_activations), parallel_output=True).to(dtype)


def _global_batch():
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(1, 64, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]  # tokens, labels: [G, s]


def _loss(model, tokens, labels):
    _, _, position_ids = get_ltor_masks_and_position_ids(tokens, EOD, False, False, False)
    return model(tokens, position_ids, None, labels=labels).mean()  # mean of [b, s] losses


def _micro_batches(dp_rank, dp_size, num_micro):
    """This rank's share of the global batch: micro batch i holds rows of block i*dp+rank."""
    tokens, labels = _global_batch()
    size = GLOBAL_BATCH // (dp_size * num_micro)
    rows = [slice((i * dp_size + dp_rank) * size, (i * dp_size + dp_rank + 1) * size)
            for i in range(num_micro)]
    return [(tokens[r], labels[r]) for r in rows]


def _to_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data):
    return torch.load(io.BytesIO(data), weights_only=True)


def _grads(module):
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()}


def _ddp_step(impl, num_micro, dtype=torch.float32, bucket_mb=25.0, fp32_allreduce=False,
              checkpoint_activations=False):
    """One accumulated step through the wrapper: (grads, comm stats) of this rank."""
    module = _build_model(dtype, checkpoint_activations)
    model = wrap_data_parallel(module, impl, mpu.get_data_parallel_group(), bucket_mb,
                               fp32_allreduce)
    batches = _micro_batches(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                             num_micro)
    COMM_STATS.reset()
    for i, (tokens, labels) in enumerate(batches):
        if i < num_micro - 1:
            with model.no_sync():
                (_loss(model, tokens, labels) / num_micro).backward()
        else:
            (_loss(model, tokens, labels) / num_micro).backward()
    model.finish_gradient_synchronization()
    stats = dict(calls=COMM_STATS.calls, payload_bytes=COMM_STATS.payload_bytes,
                 launched_in_backward=COMM_STATS.launched_in_backward,
                 buckets=len(getattr(model, "buckets", [])))
    return _grads(module), stats


def _local_then_flat_allreduce():
    """Unsynchronised local grads, then the trainer's former flat all-reduce over them."""
    module = _build_model()
    (tokens, labels), = _micro_batches(mpu.get_data_parallel_rank(),
                                       mpu.get_data_parallel_world_size(), 1)
    _loss(module, tokens, labels).backward()
    grads = [p.grad for p in module.parameters()]
    flat = torch._utils._flatten_dense_tensors(grads).div_(mpu.get_data_parallel_world_size())
    dist.all_reduce(flat, group=mpu.get_data_parallel_group())
    return dict(zip([n for n, _ in module.named_parameters()],
                    torch._utils._unflatten_dense_tensors(flat, grads)))


def _double_backward_error():
    model = wrap_data_parallel(_build_model(), "local", mpu.get_data_parallel_group())
    (tokens, labels), = _micro_batches(mpu.get_data_parallel_rank(),
                                       mpu.get_data_parallel_world_size(), 1)
    _loss(model, tokens, labels).backward()  # launches all buckets (one bucket here)
    try:
        _loss(model, tokens, labels).backward()
    except RuntimeError as error:
        message = str(error)
    else:
        message = None
    model.finish_gradient_synchronization()  # the launched all-reduce completes on all ranks
    return message


def _bf16_local_grads(num_micro=1):
    """This rank's bf16 gradients (accumulated in bf16) before any synchronisation."""
    module = _build_model(torch.bfloat16)
    for tokens, labels in _micro_batches(mpu.get_data_parallel_rank(),
                                         mpu.get_data_parallel_world_size(), num_micro):
        (_loss(module, tokens, labels) / num_micro).backward()
    return _grads(module)


def dp2_worker(rank, world_size):
    mpu.initialize_model_parallel(1)
    out = dict(local=_ddp_step("local", 1),
               local_accum_small_buckets=_ddp_step("local", 2, bucket_mb=0.004),
               torch_accum=_ddp_step("torch", 2), flat=_local_then_flat_allreduce(),
               one_bucket=_ddp_step("local", 1, bucket_mb=1000.0),
               many_buckets=_ddp_step("local", 1, bucket_mb=0.001),
               checkpointed=_ddp_step("local", 2, bucket_mb=0.004, checkpoint_activations=True),
               bf16_local_accum=_bf16_local_grads(2),
               bf16_fp32_allreduce_accum=_ddp_step("local", 2, torch.bfloat16, bucket_mb=0.004,
                                                   fp32_allreduce=True),
               double_backward=_double_backward_error())
    return _to_bytes(out)


def world4_worker(rank, world_size, impl):
    """Both layouts of 4 processes; torch's DDP costs ~5 s of imports per process."""
    mpu.initialize_model_parallel(1)
    out = dict(dp4=_ddp_step(impl, 1), bf16_local=_bf16_local_grads(),
               bf16=_ddp_step(impl, 1, torch.bfloat16),
               bf16_fp32_allreduce=_ddp_step(impl, 1, torch.bfloat16, fp32_allreduce=True))
    mpu.initialize_model_parallel(2)  # tensor-parallel 2 x data-parallel 2
    out["tp2_accum"] = _ddp_step(impl, 2, bucket_mb=0.004)
    return _to_bytes(out)


def trainer_worker(rank, world_size, argv_by_impl, ports):
    """pretrain_gpt2.main once per --DDP-impl, as torchrun would launch it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1")
    codes = {}
    for (impl, argv), port in zip(argv_by_impl.items(), ports):
        os.environ["MASTER_PORT"] = str(port)  # the first run reuses the test's process group
        codes[impl] = pretrain_gpt2.main(argv)
    return codes


# ---------------------------------------------------------------------------- parent side

@pytest.fixture(scope="module")
def dp2():
    return [_from_bytes(data) for data in run_distributed(dp2_worker, 2)]


@pytest.fixture(scope="module", params=["local", pytest.param("torch", marks=pytest.mark.slow)])
def world4(request):
    return [_from_bytes(data) for data in run_distributed(world4_worker, 4, args=(request.param,))]


def _reference(dtype=torch.float32):
    """Gradients of one process on the whole global batch, and the model's parameters."""
    model = _build_model(dtype)
    _loss(model, *_global_batch()).backward()
    return _grads(model), dict(model.named_parameters())


def _expected_shard(full, param, tp_rank, tp_size=2):
    """The slice of a full tensor that tensor-parallel rank `tp_rank` holds."""
    if not getattr(param, "model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    block = full.size(dim) // (stride * tp_size)
    return torch.cat([full.narrow(dim, (k * tp_size + tp_rank) * block, block)
                      for k in range(stride)], dim)


def _assert_grads_match(got, expected, rtol=1e-6, what=""):
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        ref = expected[name]
        # atol scaled to the tensor: entries near zero carry only absolute rounding error
        atol = rtol * ref.abs().max().item()
        torch.testing.assert_close(grad, ref, rtol=rtol, atol=atol, msg=f"{what} {name}")


def _numel(grads, element_size):
    return sum(g.numel() for g in grads.values()) * element_size


@pytest.mark.parametrize("case", ["local", "local_accum_small_buckets", "torch_accum",
                                  "checkpointed"])
def test_dp2_grads_equal_single_process_full_batch(dp2, case):
    reference, _ = _reference()
    for out in dp2:
        _assert_grads_match(out[case][0], reference, what=case)


def test_dp2_bucketing_reproduces_flat_allreduce_bit_for_bit(dp2):
    for out in dp2:
        for case in ("local", "one_bucket", "many_buckets"):
            for name, grad in out[case][0].items():
                assert torch.equal(grad, out["flat"][name]), (case, name)
        assert out["one_bucket"][1]["buckets"] == 1
        assert out["many_buckets"][1]["buckets"] > 5


def test_dp2_buckets_are_reduced_during_backward_and_bytes_counted(dp2):
    reference, _ = _reference()
    for out in dp2:
        grads, stats = out["local_accum_small_buckets"]
        # One all-reduce per bucket, all launched from backward hooks (none at finish), and
        # only on the last micro batch: accumulation passes communicate nothing.
        assert stats["buckets"] > 5
        assert stats["calls"] == stats["launched_in_backward"] == stats["buckets"]
        assert stats["payload_bytes"] == _numel(reference, 4)
        assert out["torch_accum"][1]["payload_bytes"] == _numel(reference, 4)


def test_finishing_a_gradient_twice_is_a_clear_error(dp2):
    for out in dp2:
        assert out["double_backward"] is not None and "no_sync()" in out["double_backward"]


def test_dp4_grads_equal_single_process_full_batch(world4):
    reference, _ = _reference()
    for out in world4:
        _assert_grads_match(out["dp4"][0], reference)
        assert out["dp4"][1]["payload_bytes"] == _numel(reference, 4)


def test_tp2_dp2_grads_equal_slices_of_single_process(world4):
    reference, params = _reference()
    for rank, out in enumerate(world4):
        tp_rank = rank % 2  # adjacent ranks form the tensor-parallel groups
        expected = {name: _expected_shard(ref, params[name], tp_rank)
                    for name, ref in reference.items()}
        _assert_grads_match(out["tp2_accum"][0], expected, what=f"rank {rank}")
        assert out["tp2_accum"][1]["payload_bytes"] == _numel(expected, 4)


def test_bf16_fp32_allreduce_rounds_the_exact_mean_once(world4):
    """fp32 all-reduce: bf16(mean of the 4 ranks' bf16 grads); bf16 all-reduce rounds more."""
    local = [out["bf16_local"] for out in world4]
    exact = {name: sum(g[name].double() for g in local) / len(local) for name in local[0]}
    bf16_errors = []
    for out in world4:
        for name, grad in out["bf16_fp32_allreduce"][0].items():
            assert grad.dtype == torch.bfloat16
            assert torch.equal(grad, exact[name].to(torch.bfloat16)), name
        for name, grad in out["bf16"][0].items():
            error = (grad.double() - exact[name]).abs().max().item()
            bf16_errors.append(error)
            # bf16 summation still lands within a few bf16 ulps of the exact mean
            assert error <= 2 ** -6 * exact[name].abs().max().item(), name
        assert out["bf16_fp32_allreduce"][1]["payload_bytes"] == \
            2 * out["bf16"][1]["payload_bytes"] == _numel(exact, 4)
    assert max(bf16_errors) > 0, "bf16 all-reduce was exact: the test cannot tell fp32 apart"


def test_dp2_bf16_accumulation_with_fp32_allreduce_is_the_exact_mean(dp2):
    local = [out["bf16_local_accum"] for out in dp2]
    for out in dp2:
        for name, grad in out["bf16_fp32_allreduce_accum"][0].items():
            exact = (local[0][name].double() + local[1][name].double()) / 2
            assert torch.equal(grad, exact.to(torch.bfloat16)), name


def test_bf16_ddp_grads_close_to_single_process_full_batch(world4):
    reference, _ = _reference(torch.bfloat16)
    for out in world4:
        for name, grad in out["bf16_fp32_allreduce"][0].items():
            ref = reference[name].float()
            torch.testing.assert_close(grad.float(), ref, rtol=0,
                                       atol=3e-2 * ref.abs().max().item(), msg=name)


def _trainer_losses(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def test_trainer_dp2_matches_one_process_for_both_ddp_impls(corpus, tmp_path):  # noqa: F811
    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "3e-3",
              "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "3",
              "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0",
              "--num-workers", "0", "--threads", "1", "--data-path", corpus["prefix"],
              "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"]]
    single_dir = str(tmp_path / "single")
    assert pretrain_gpt2.main(common + ["--batch-size", "8", "--log-dir", single_dir]) == 0
    argv_by_impl = {impl: common + ["--batch-size", "2", "--DDP-impl", impl,  # 2 micro batches
                                    "--ddp-bucket-size", "0.01",
                                    "--log-dir", str(tmp_path / impl)]
                    for impl in ("local", "torch")}
    codes = run_distributed(trainer_worker, 2, args=(argv_by_impl, [free_port(), free_port()]))
    assert codes == [{"local": 0, "torch": 0}] * 2
    single = _trainer_losses(single_dir)
    assert len(single) == 3
    for impl in ("local", "torch"):
        assert _trainer_losses(str(tmp_path / impl)) == pytest.approx(single, rel=1e-5), impl


_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
          "--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
          "--merge-file", "m"]


def test_ddp_flags_parse_with_megatron_names():
    args = parse_args(_FLAGS, world_size=2)
    assert (args.DDP_impl, args.ddp_bucket_size, args.fp32_allreduce) == ("local", 25.0, False)
    args = parse_args(_FLAGS + ["--DDP-impl", "torch", "--ddp-bucket-size", "4",
                                "--fp32-allreduce", "--bf16"], world_size=2)
    assert (args.DDP_impl, args.ddp_bucket_size, args.fp32_allreduce) == ("torch", 4.0, True)
    with pytest.raises(ConfigError, match="--ddp-bucket-size must be a positive"):
        parse_args(_FLAGS + ["--ddp-bucket-size", "0"], world_size=2)
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(_FLAGS + ["--DDP-impl", "apex"], world_size=2)
