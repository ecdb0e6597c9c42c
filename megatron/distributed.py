"""Data-parallel gradient synchronisation: `--DDP-impl local` and `--DDP-impl torch`.

Both wrappers give the train loop the same two calls:

    for i, batch in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss(batch).backward()              # accumulation passes stay local
    model.finish_gradient_synchronization()     # grads now hold the data-parallel mean
    optimizer.step()

`local` (Megatron's default) packs gradients into contiguous buckets of about
`bucket_size_mb` megabytes, in reverse parameter order, which is roughly the order backward
finishes them. A post-accumulate-grad hook on every parameter copies its finished gradient
into its bucket and makes `param.grad` a view of that slot (so the reduced mean lands in place
and the original gradient is freed); the moment a bucket is complete its all-reduce is
launched asynchronously, so communication overlaps the rest of backward. Buckets are launched
strictly in order, so all ranks issue the same collectives in the same order whatever order
their hooks fire in. `finish_gradient_synchronization` launches what is left and waits; with
`--fp32-allreduce` on 16-bit gradients it also copies the fp32 means back into them.

`torch` is `torch.nn.parallel.DistributedDataParallel` over the data-parallel group, with a
communication hook that does the same averaging (and the same fp32 up-cast) and counts bytes.

`COMM_STATS` counts, per rank, what the gradient all-reduces carried and how long the train
loop waited for them; the scaling benchmark resets and reads it every iteration.
"""

import contextlib
import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommunicationStats:
    """Gradient all-reduce traffic of this rank since the last `reset()`.

    A ring all-reduce of `payload_bytes` sends 2 (N - 1) / N x payload_bytes per rank.
    `wait_seconds` is host time: on CUDA, waiting on an NCCL handle only orders streams.
    """
    calls: int = 0
    payload_bytes: int = 0          # bytes of the buffers handed to all_reduce
    launched_in_backward: int = 0   # local DDP: buckets launched before finish (overlap)
    wait_seconds: float = 0.0       # local DDP: time finish spent waiting for the reduces

    def reset(self):
        self.calls = self.payload_bytes = self.launched_in_backward = 0
        self.wait_seconds = 0.0

    def record(self, tensor):
        self.calls += 1
        self.payload_bytes += tensor.numel() * tensor.element_size()


COMM_STATS = CommunicationStats()


def wrap_data_parallel(model, impl, group, bucket_size_mb=25.0, fp32_allreduce=False):
    """The model wrapped for `--DDP-impl` `impl` ("local" or "torch") over `group`."""
    if impl == "local":
        return DistributedDataParallel(model, group, bucket_size_mb, fp32_allreduce)
    if impl == "torch":
        return TorchDistributedDataParallel(model, group, bucket_size_mb, fp32_allreduce)
    raise ValueError(f"unknown DDP implementation {impl!r}; expected 'local' or 'torch'")


class _Bucket:
    """A flat buffer holding the gradients of consecutive parameters (in backward order)."""

    def __init__(self, params, dtype, device):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.slots, offset = {}, 0
        for param in params:
            # [numel] view of the buffer, shaped like the parameter
            self.slots[param] = self.buffer.narrow(0, offset, param.numel()).view_as(param)
            offset += param.numel()
        self.reset()

    def reset(self):
        self.ready, self.handle = set(), None

    @property
    def complete(self):
        return len(self.ready) == len(self.params)

    def add_gradient(self, param):
        slot = self.slots[param]
        if param.grad is None:  # unused in this pass: contributes zeros
            slot.zero_()
        elif param.grad.data_ptr() != slot.data_ptr():  # (equal: zero_grad kept our view)
            slot.copy_(param.grad)
        if slot.dtype == param.dtype:
            param.grad = slot  # the grad lives in the bucket from now on: no second copy
        self.ready.add(param)

    def write_back(self):
        """--fp32-allreduce: copy the fp32 means back into the 16-bit grads."""
        for param, slot in self.slots.items():
            if slot.dtype != param.dtype:
                if param.grad is None:
                    param.grad = slot.to(param.dtype)
                else:
                    param.grad.copy_(slot)


class DistributedDataParallel(torch.nn.Module):
    """Megatron's local DDP: bucketed gradient all-reduce overlapped with backward.

    Gradients are averaged (sum / data-parallel size) over `group`. With `fp32_allreduce`,
    16-bit gradients are cast into fp32 buckets and reduced in fp32. `state_dict()` and
    `load_state_dict()` are the wrapped module's, so checkpoints hold the unwrapped keys.
    """

    def __init__(self, module, group, bucket_size_mb=25.0, fp32_allreduce=False):
        super().__init__()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.fp32_allreduce = fp32_allreduce
        self._sync_enabled = True
        self._next_launch = 0  # buckets are launched in order; this one is next
        self.buckets = self._build_buckets(bucket_size_mb) if self.world_size > 1 else []
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for param in self._bucket_of:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _comm_dtype(self, param):
        return torch.float32 if self.fp32_allreduce else param.dtype

    def _build_buckets(self, bucket_size_mb):
        """Reverse parameter order, split by (dtype, device), each about bucket_size_mb."""
        filling = {}  # (dtype, device) -> [params, numel] of the bucket being filled
        buckets = []
        params = [p for p in self.module.parameters() if p.requires_grad]
        for param in reversed(params):
            key = (self._comm_dtype(param), param.device)
            members = filling.setdefault(key, [[], 0])
            members[0].append(param)
            members[1] += param.numel()
            if members[1] * key[0].itemsize >= bucket_size_mb * 2 ** 20:
                buckets.append(_Bucket(members[0], *key))
                del filling[key]
        buckets += [_Bucket(members, *key) for key, (members, _) in filling.items()]
        return buckets

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally (accumulation steps)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, param):
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[param]
        if param in bucket.ready or bucket.handle is not None:
            raise RuntimeError(
                f"the gradient of a parameter of shape {tuple(param.shape)} was finished twice "
                "before finish_gradient_synchronization(): run all but the last micro batch's "
                "backward inside model.no_sync(), and call finish_gradient_synchronization() "
                "once per optimizer step")
        bucket.add_gradient(param)
        if bucket.complete:
            self._launch_complete_buckets()

    def _launch_complete_buckets(self):
        while self._next_launch < len(self.buckets) and \
                self.buckets[self._next_launch].complete:
            bucket = self.buckets[self._next_launch]
            bucket.buffer.div_(self.world_size)  # average as sum of (grad / N): no overflow
            bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            COMM_STATS.record(bucket.buffer)
            self._next_launch += 1

    def finish_gradient_synchronization(self):
        """Launch the remaining buckets, wait for all, and hand the means to `param.grad`.

        Parameters that received no gradient in this pass contribute zeros, and get the mean
        of the other ranks' gradients (zeros if no rank used them).
        """
        if not self.buckets:
            return
        assert self._sync_enabled, "finish_gradient_synchronization() inside no_sync()"
        launched_in_backward = self._next_launch
        for bucket in self.buckets[self._next_launch:]:
            for param in bucket.params:
                if param not in bucket.ready:
                    bucket.add_gradient(param)
        self._launch_complete_buckets()
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.handle.wait()
        COMM_STATS.wait_seconds += time.perf_counter() - start
        COMM_STATS.launched_in_backward += launched_in_backward
        for bucket in self.buckets:
            bucket.write_back()
            bucket.reset()
        self._next_launch = 0


# Buffers are computed identically on every rank: broadcasting them in every forward would
# only add a collective (and one evaluation may run more forwards than another). torch 2.13
# renamed the switch and warns about the old name.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(
        torch.nn.parallel.DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False})


class TorchDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP over `group`, with the local wrapper's `finish_gradient_synchronization`.

    torch's reducer waits for its all-reduces at the end of backward, so finishing is a no-op
    here. A communication hook averages each bucket (in fp32 with `fp32_allreduce`) and
    counts its bytes in `COMM_STATS`.
    """

    def __init__(self, module, group, bucket_size_mb=25.0, fp32_allreduce=False):
        first = next(module.parameters())
        device_ids = [first.device.index] if first.device.type == "cuda" else None
        super().__init__(module, device_ids=device_ids, process_group=group,
                         bucket_cap_mb=bucket_size_mb, **_NO_FORWARD_BUFFER_SYNC)
        self.register_comm_hook(_HookState(group, dist.get_world_size(group), fp32_allreduce),
                                _averaging_allreduce_hook)

    def finish_gradient_synchronization(self):
        """Nothing left to do: torch's reducer finished the all-reduces inside backward."""


@dataclass
class _HookState:
    group: object
    world_size: int
    fp32_allreduce: bool


def _averaging_allreduce_hook(state, bucket):
    """torch DDP comm hook: mean over the group, optionally reduced in fp32."""
    buffer = bucket.buffer()
    reduced = buffer.float() if state.fp32_allreduce else buffer
    reduced.div_(state.world_size)
    COMM_STATS.record(reduced)
    future = dist.all_reduce(reduced, group=state.group, async_op=True).get_future()

    def back_to_bucket_dtype(fut):
        result = fut.value()[0]
        if result is not buffer:
            buffer.copy_(result)
        return buffer

    return future.then(back_to_bucket_dtype)
