"""Data-parallel gradient reduction (the zero engine at stage 0, --DDP-impl local and torch)
against one process.

Every gloo run computes gradients of one global batch split over data-parallel ranks (and
micro batches) through the engine; the reference is the same model in the test process on the
whole batch.
"""

import io
import json
import os

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt2
import zero
from megatron import mpu
from megatron.config import resolve_config
from megatron.errors import ConfigError
from megatron.model import GPT2Model, GPTConfig, get_ltor_masks_and_position_ids
from megatron.training.torch_ddp import wrap_torch_ddp
from tests.dist_utils import free_port, run_distributed
from tests.training.conftest import corpus  # noqa: F401  (the fixture)
from zero.stages.bucket_reduction import reduces_in_masters

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


def _engine(impl, num_micro, dtype, bucket_mb, fp32_allreduce, checkpoint_activations,
            accum_dtype=None):
    """The trainer's engine without --deepspeed: ZeRO stage 0 (and torch's DDP for 'torch');
    `accum_dtype` its data_types.grad_accum_dtype (None: bf16 sums in fp32 at stage 0)."""
    module = _build_model(dtype, checkpoint_activations)
    model = module
    if impl == "torch":
        model = wrap_torch_ddp(module, mpu.get_data_parallel_group(), bucket_mb, fp32_allreduce)
    itemsize = 4 if fp32_allreduce or dtype == torch.float32 else 2
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // num_micro //
              mpu.get_data_parallel_world_size(), "gradient_accumulation_steps": num_micro,
              "zero_optimization": {"stage": 0, "overlap_comm": True,
                                    "reduce_bucket_size": int(bucket_mb * 2 ** 20 / itemsize)},
              "bf16": {"enabled": dtype == torch.bfloat16}}
    if fp32_allreduce:
        config["communication_data_type"] = "fp32"
    if accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": accum_dtype}
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(module.parameters()),
                                 mpu=mpu, config=config)
    return engine


def _reduced_grads(engine):
    """{name: reduced gradient} after the last backward: param.grad, or the fp32 masters'
    gradient when 16-bit gradients were reduced in fp32."""
    grads = {}
    names = {p: n for n, p in engine.module.named_parameters()}
    for group in engine.optimizer.groups:
        in_masters = reduces_in_masters(engine.optimizer.settings, group)
        for param, offset, numel in zip(group.params, group.layout.offsets,
                                        group.layout.numels):
            grad = group.master.grad[offset:offset + numel].view_as(param) if in_masters \
                else param.grad
            grads[names[param]] = grad.detach().clone()
    return grads


def _ddp_step(impl, num_micro, dtype=torch.float32, bucket_mb=25.0, fp32_allreduce=False,
              checkpoint_activations=False, accum_dtype=None):
    """One accumulated step's backward through the engine: (grads, comm stats) of this rank."""
    engine = _engine(impl, num_micro, dtype, bucket_mb, fp32_allreduce, checkpoint_activations,
                     accum_dtype)
    batches = _micro_batches(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                             num_micro)
    stats = engine.optimizer.dp_comm.stats
    stats.reset()
    first_param = next(engine.module.parameters())  # the word embeddings: its gradient is last
    launched = []
    first_param.register_hook(lambda grad: launched.append(stats.calls("all_reduce")))
    for tokens, labels in batches:
        engine.backward(_loss(engine, tokens, labels))
        # what engine.step() counts, without its optimizer step at the last micro batch
        engine.micro_steps += 1
    groups = engine.optimizer.groups
    result = dict(calls=stats.calls("all_reduce"),
                  payload_bytes=stats.ops["all_reduce"].payload_bytes if stats.calls(
                      "all_reduce") else 0,
                  launched_before_last_grad=launched[-1],
                  buckets=sum(g.layout.num_buckets for g in groups),
                  # the flat buffers: the gradients plus alignment padding (zeros)
                  flat_bytes=sum(g.layout.total * (4 if reduces_in_masters(engine.optimizer.settings, g)
                                                   else g.full_grads.element_size())
                                 for g in groups))
    grads = _reduced_grads(engine)
    engine.destroy()
    return grads, result


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


def _bf16_micro_grads(num_micro):
    """This rank's bf16 gradients of each micro batch (its loss / num_micro), apart."""
    module, found = _build_model(torch.bfloat16), []
    for tokens, labels in _micro_batches(mpu.get_data_parallel_rank(),
                                         mpu.get_data_parallel_world_size(), num_micro):
        module.zero_grad()
        (_loss(module, tokens, labels) / num_micro).backward()
        found.append(_grads(module))
    return found


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
               bf16_micro=_bf16_micro_grads(2),
               bf16_accum=_ddp_step("local", 2, torch.bfloat16, bucket_mb=0.004),
               bf16_fp32_allreduce_accum=_ddp_step("local", 2, torch.bfloat16, bucket_mb=0.004,
                                                   accum_dtype="bf16",
                                                   fp32_allreduce=True))
    return _to_bytes(out)


def world4_worker(rank, world_size, impl):
    """Both layouts of 4 processes, in one start of the ranks."""
    mpu.initialize_model_parallel(1)
    out = dict(impl=impl, dp4=_ddp_step(impl, 1), bf16_local=_bf16_local_grads(),
               bf16=_ddp_step(impl, 1, torch.bfloat16, accum_dtype="bf16"),
               bf16_default=_ddp_step(impl, 1, torch.bfloat16),
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


def _assert_payload(stats, gradient_bytes):
    """The all-reduces carried the flat gradient buffers, whose padding is a few percent."""
    assert stats["payload_bytes"] == stats["flat_bytes"]
    assert gradient_bytes <= stats["flat_bytes"] <= 1.03 * gradient_bytes


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
        # One all-reduce per bucket, most launched from backward hooks before the last
        # gradient is done, and only on the last micro batch: accumulation passes
        # communicate nothing.
        assert stats["buckets"] > 5
        assert stats["calls"] == stats["buckets"]
        assert 0 < stats["launched_before_last_grad"] < stats["buckets"]
        _assert_payload(stats, _numel(reference, 4))


def test_dp4_grads_equal_single_process_full_batch(world4):
    reference, _ = _reference()
    for out in world4:
        _assert_grads_match(out["dp4"][0], reference)
        if out["impl"] == "local":  # (torch's DDP all-reduces outside the engine's counters)
            _assert_payload(out["dp4"][1], _numel(reference, 4))


def test_tp2_dp2_grads_equal_slices_of_single_process(world4):
    reference, params = _reference()
    for rank, out in enumerate(world4):
        tp_rank = rank % 2  # adjacent ranks form the tensor-parallel groups
        expected = {name: _expected_shard(ref, params[name], tp_rank)
                    for name, ref in reference.items()}
        _assert_grads_match(out["tp2_accum"][0], expected, what=f"rank {rank}")
        if out["impl"] == "local":
            _assert_payload(out["tp2_accum"][1], _numel(expected, 4))


def test_bf16_fp32_allreduce_is_the_exact_mean(world4):
    """fp32 all-reduce (--fp32-allreduce, or bf16's default fp32 sums at stage 0): the fp32
    masters' gradients hold the mean of the 4 ranks' bf16 gradients, exact in fp32 (torch's
    DDP: rounded to bf16 once); bf16 all-reduce (grad_accum_dtype "bf16") rounds more."""
    local = [out["bf16_local"] for out in world4]
    exact = {name: sum(g[name].double() for g in local) / len(local) for name in local[0]}
    bf16_errors = []
    for out in world4:
        # (torch's DDP reduces in bf16 unless asked: the default is the engine's own)
        variants = ("bf16_fp32_allreduce", "bf16_default") if out["impl"] == "local" \
            else ("bf16_fp32_allreduce",)
        for variant in variants:
            for name, grad in out[variant][0].items():
                if out["impl"] == "local":
                    assert grad.dtype == torch.float32
                    torch.testing.assert_close(grad.double(), exact[name], rtol=1e-6, atol=0,
                                               msg=f"{variant} {name}")
                else:
                    assert torch.equal(grad, exact[name].to(torch.bfloat16)), name
        for name, grad in out["bf16"][0].items():
            error = (grad.double() - exact[name]).abs().max().item()
            bf16_errors.append(error)
            # bf16 summation still lands within a few bf16 ulps of the exact mean
            assert error <= 2 ** -6 * exact[name].abs().max().item(), name
        if out["impl"] == "local":
            _assert_payload(out["bf16_fp32_allreduce"][1], _numel(exact, 4))
            _assert_payload(out["bf16_default"][1], _numel(exact, 4))
            _assert_payload(out["bf16"][1], _numel(exact, 2))
    assert max(bf16_errors) > 0, "bf16 all-reduce was exact: the test cannot tell fp32 apart"


def test_dp2_bf16_micro_batches_are_summed_and_reduced_in_fp32(dp2):
    """bf16 at stage 0 by default: each rank sums its two micro batches' bf16 gradients in
    fp32 and the mean over ranks is reduced in fp32: the exact mean, to fp32 rounding."""
    micro = [out["bf16_micro"] for out in dp2]
    for out in dp2:
        for name, grad in out["bf16_accum"][0].items():
            exact = sum(g[name].double() for rank in micro for g in rank) / 2
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad.double(), exact, rtol=1e-6, atol=0, msg=name)


def test_dp2_bf16_accumulation_with_fp32_allreduce_is_the_exact_mean(dp2):
    """grad_accum_dtype "bf16": each rank accumulates its two micro batches in bf16; their mean
    is reduced in fp32 (--fp32-allreduce)."""
    local = [out["bf16_local_accum"] for out in dp2]
    for out in dp2:
        for name, grad in out["bf16_fp32_allreduce_accum"][0].items():
            exact = (local[0][name].double() + local[1][name].double()) / 2
            torch.testing.assert_close(grad.double(), exact, rtol=1e-6, atol=0, msg=name)


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
    config = resolve_config(_FLAGS, world_size=2)
    assert (config.parallel.DDP_impl, config.parallel.ddp_bucket_size) == ("local", 25.0)
    assert config.engine.ds_config.communication_data_type is None
    config = resolve_config(_FLAGS + ["--DDP-impl", "torch", "--ddp-bucket-size", "4",
                                      "--fp32-allreduce", "--bf16"], world_size=2)
    assert (config.parallel.DDP_impl, config.parallel.ddp_bucket_size) == ("torch", 4.0)
    assert config.engine.ds_config.communication_data_type == "fp32"
    with pytest.raises(ConfigError, match="--ddp-bucket-size must be a positive"):
        resolve_config(_FLAGS + ["--ddp-bucket-size", "0"], world_size=2)
    with pytest.raises(ConfigError, match="argument --DDP-impl: invalid choice: 'apex'"):
        resolve_config(_FLAGS + ["--DDP-impl", "apex"], world_size=2)
