"""ZeRO stage 3 parameters: every parameter partitioned over the data-parallel group.

A partitioned parameter keeps its `nn.Parameter` object (autograd, optimizers and module
attributes keep working) but its `.data` is an empty placeholder of the model's dtype and
device. Its values live in `param.ds_tensor`, this rank's 1/world piece of the flattened
tensor, zero padded (as deepspeed/runtime/zero/partition_parameters.py cuts it):

    flat param [numel] padded to world * s,  s = ceil(numel / world)
    rank r holds elements [r*s, (r+1)*s) in ds_tensor [s]

`gather`/`release` swap the full tensor in and out of `param.data`. DeepSpeed's attributes are
set on each parameter: ds_id, ds_shape, ds_numel, ds_tensor, ds_status, ds_persist.

`Init` partitions modules while they are built (after each submodule's __init__, so a rank
never holds more than one submodule in full); `GatheredParameters` (gathered_parameters.py)
gathers for user code on top of this module's gather, release and re-partition;
`register_external_parameter`
tells stage 3 that a module uses a parameter owned by another module (a tied weight).
"""

import enum
import functools
import inspect
import itertools
import math
import weakref

import torch
from torch import nn

from zero.comm.communicator import Communicator
from zero.comm.process_group import init_distributed
from zero.errors import ConfigError, ZeroError


class ParamStatus(enum.Enum):
    AVAILABLE = 1  # full tensor in param.data
    NOT_AVAILABLE = 2  # only the partition
    INFLIGHT = 3  # all-gather launched, not yet waited for


_ds_ids = itertools.count()
# untyped storage address of a gathered buffer -> its parameter: lets the saved-tensor hooks
# of stage 3 recognise a parameter (or a view of it, e.g. weight.t()) that autograd saves.
_GATHERED_STORAGE = {}
REMOTE_DEVICES = ("none", "cpu", "nvme")


def is_zero_param(tensor):
    return hasattr(tensor, "ds_id")


def partition_numel(numel, world_size):
    return math.ceil(numel / world_size)


def param_of_storage(tensor):
    """The gathered ZeRO parameter whose full buffer `tensor` lives in, else None."""
    if not _GATHERED_STORAGE:
        return None
    return _GATHERED_STORAGE.get(tensor.untyped_storage().data_ptr())


def allocate_partition(numel, dtype, device, remote_device=None, pin_memory=False):
    """Storage for one partition. The one place that decides where shards live, so parameter
    offload can put them elsewhere: "none" (the compute device), "cpu" (host memory, pinned
    when asked and CUDA exists; on a CPU-only machine the same memory as "none"), "nvme"."""
    if remote_device in ("cpu", "nvme"):  # nvme: staged on the host, then written out
        pin = pin_memory and torch.cuda.is_available()
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)
    return torch.zeros(numel, dtype=dtype, device=device)


def normalize_remote_device(remote_device):
    value = "none" if remote_device is None else str(remote_device).lower()
    if value not in REMOTE_DEVICES:
        raise ConfigError(f"remote_device {remote_device!r} is not one of "
                          f"{', '.join(REMOTE_DEVICES)}")
    return value


# ---------------------------------------------------------------------------------------------
# One parameter: partition, gather, release

@torch.no_grad()
def partition_param(param, comm, remote_device="none", pin_memory=False, dtype=None,
                    broadcast=True, swapper=None):
    """Turn `param` into a ZeRO parameter over `comm`. With `broadcast`, every rank takes its
    piece of DP rank 0's values (so all ranks start alike, as DeepSpeed does). remote_device
    "nvme" writes the piece to a swap file of `swapper` (zero/offload/param_swapper.py)."""
    if remote_device == "nvme" and swapper is None:
        raise ConfigError("remote_device 'nvme' needs zero_optimization.offload_param with "
                          "device 'nvme' and an nvme_path in the DeepSpeed config")
    data = param.data
    if broadcast and comm.world_size > 1:
        data = data.contiguous()
        comm.broadcast(data)
    numel, world = data.numel(), comm.world_size
    size = partition_numel(numel, world)
    dtype = dtype or data.dtype
    shard = allocate_partition(size, dtype, data.device, remote_device, pin_memory)
    lo, hi = comm.rank * size, min(numel, (comm.rank + 1) * size)
    if lo < hi:
        shard.narrow(0, 0, hi - lo).copy_(data.reshape(-1)[lo:hi])
    param.ds_id = next(_ds_ids)
    param.ds_shape = tuple(data.shape)
    param.ds_numel = numel
    param.ds_tensor = shard
    param.ds_status = ParamStatus.NOT_AVAILABLE
    param.ds_persist = False
    param.ds_process_group = comm.group
    param.ds_comm = comm
    param.ds_full = None  # the padded full buffer while gathered
    param.ds_pending = None
    param.ds_active_sub_modules = 0
    param.ds_remote_device = remote_device
    param.ds_swapper = swapper if remote_device == "nvme" else None
    if param.ds_swapper is not None:  # the shard's bytes go to its file
        param.ds_tensor = swapper.offload(param, shard)
    param.data = torch.empty(0, dtype=dtype, device=data.device)
    return param


def start_gather(param):
    """Launch the all-gather of `param` (no-op if it is available or in flight)."""
    if param.ds_status is not ParamStatus.NOT_AVAILABLE:
        return
    comm, size = param.ds_comm, param.ds_tensor.numel()
    device = param.data.device  # the placeholder carries the compute device and dtype
    source = param.ds_tensor
    if getattr(param, "ds_swapper", None) is not None:
        from zero.offload.param_swapper import read_shard
        source = read_shard(param)  # from NVMe (read ahead along the trace, if prefetched)
    if source.device != device or source.dtype != param.data.dtype:
        source = source.to(device=device, dtype=param.data.dtype)
    buffer = torch.empty(size * comm.world_size, dtype=source.dtype, device=device)
    param.ds_pending = comm.all_gather(buffer, source, async_op=True)
    param.ds_gather_source = source  # alive until the all-gather is waited for
    param.ds_full = buffer
    param.ds_status = ParamStatus.INFLIGHT


def finish_gather(param):
    if param.ds_status is ParamStatus.NOT_AVAILABLE:
        start_gather(param)
    if param.ds_status is ParamStatus.INFLIGHT:
        param.ds_pending.wait()
        param.ds_pending = param.ds_gather_source = None
        _make_available(param, param.ds_full)


def _make_available(param, full):
    param.ds_full = full
    param.data = full.narrow(0, 0, param.ds_numel).view(param.ds_shape)
    _GATHERED_STORAGE[full.untyped_storage().data_ptr()] = param
    param.ds_status = ParamStatus.AVAILABLE


def gather_coalesced(params):
    """Gather not-available `params` with one all-gather per communicator, dtype and device
    (the persistent small parameters after a step: one collective instead of one each, whose
    fixed cost dominates for a bias). Parameters whose shard is swapped to NVMe are left to
    `start_gather`. Returns the number of all-gathers issued."""
    groups = {}
    for param in params:
        if param.ds_status is ParamStatus.NOT_AVAILABLE \
                and getattr(param, "ds_swapper", None) is None:
            key = (id(param.ds_comm), param.data.dtype, param.data.device)
            groups.setdefault(key, []).append(param)
    for group in groups.values():
        comm, world = group[0].ds_comm, group[0].ds_comm.world_size
        dtype, device = group[0].data.dtype, group[0].data.device
        sizes = [p.ds_tensor.numel() for p in group]
        total = sum(sizes)
        packed = torch.cat([p.ds_tensor.to(device=device, dtype=dtype) for p in group])
        rows = torch.empty(world, total, dtype=dtype, device=device)
        comm.all_gather(rows.view(-1), packed)
        offset = 0
        for param, size in zip(group, sizes):
            full = torch.empty(world, size, dtype=dtype, device=device)
            full.copy_(rows.narrow(1, offset, size))
            _make_available(param, full.view(-1))
            offset += size
    return len(groups)


def gather_params(params):
    """Gather all `params` (launch every all-gather, then wait for them)."""
    for param in params:
        start_gather(param)
    for param in params:
        finish_gather(param)


def release_param(param):
    """Drop the full tensor; only the partition stays."""
    if param.ds_status is ParamStatus.NOT_AVAILABLE:
        return
    if param.ds_status is ParamStatus.INFLIGHT:
        param.ds_pending.wait()
        param.ds_pending = param.ds_gather_source = None
    else:
        _GATHERED_STORAGE.pop(param.ds_full.untyped_storage().data_ptr(), None)
    param.data = torch.empty(0, dtype=param.data.dtype, device=param.data.device)
    param.ds_full = None
    param.ds_status = ParamStatus.NOT_AVAILABLE


@torch.no_grad()
def repartition_from_full(param):
    """Copy this rank's piece of the (gathered, possibly edited) full tensor into ds_tensor."""
    write_full_value(param, param.data)


@torch.no_grad()
def write_full_value(param, full):
    """This rank's piece of `full` (the whole parameter's values, which every rank has, e.g.
    read from a checkpoint) into the partition: no collective. The stage 3 optimizer's fp32
    master follows."""
    if param.ds_status is ParamStatus.INFLIGHT:  # (its gather would bring the old values)
        finish_gather(param)
    if full is not param.data and param.ds_status is ParamStatus.AVAILABLE:
        param.data.copy_(full.reshape(param.data.shape))  # gathered now (a persistent one)
    size, rank = param.ds_tensor.numel(), param.ds_comm.rank
    flat = full.reshape(-1)
    lo, hi = rank * size, min(param.ds_numel, (rank + 1) * size)
    if getattr(param, "ds_swapper", None) is not None:
        from zero.offload.param_swapper import write_shard
        piece = torch.zeros(size, dtype=param.ds_tensor.dtype)
        if lo < hi:
            piece.narrow(0, 0, hi - lo).copy_(flat[lo:hi])
        write_shard(param, piece)
    elif lo < hi:
        param.ds_tensor.narrow(0, 0, hi - lo).copy_(flat[lo:hi])
    hook = getattr(param, "ds_on_partition_update", None)
    if hook is not None:  # the stage 3 optimizer refreshes its fp32 master from the piece
        hook(param)


def partition_module(module, comm, remote_device="none", pin_memory=False, dtype=None,
                     recurse=True, broadcast=True, swapper=None):
    """Partition the parameters of `module` that are not ZeRO parameters yet."""
    for param in module.parameters(recurse=recurse):
        if is_zero_param(param):
            if param.ds_comm.world_size != comm.world_size or param.ds_comm.rank != comm.rank:
                raise ZeroError("a parameter was partitioned by zero.Init over another "
                                "data-parallel group than the engine's; pass the same "
                                "data_parallel_group (or mpu) to zero.Init and initialize")
            param.ds_comm = comm  # one Communicator: its byte counters see all the traffic
            continue
        partition_param(param, comm, remote_device, pin_memory, dtype, broadcast, swapper)


def register_external_parameter(module, parameter):
    """Stage 3: `module`'s forward uses `parameter`, which another module owns (e.g. a tied
    output embedding used by the model's forward). It is gathered for that forward too."""
    if not isinstance(parameter, nn.Parameter):
        raise ZeroError("register_external_parameter expects an nn.Parameter")
    external = module.__dict__.setdefault("_zero_external_params", [])
    if not any(p is parameter for p in external):
        external.append(parameter)


def unregister_external_parameter(module, parameter):
    external = module.__dict__.get("_zero_external_params", [])
    module.__dict__["_zero_external_params"] = [p for p in external if p is not parameter]


def external_parameters(module):
    return module.__dict__.get("_zero_external_params", [])


# ---------------------------------------------------------------------------------------------
# zero.Init

def _init_settings(config, world_size):
    """(dtype, remote device, pin memory, parsed config) a DeepSpeed config asks of zero.Init."""
    from zero.config.deepspeed_config import DeepSpeedConfig
    parsed = config if isinstance(config, DeepSpeedConfig) else DeepSpeedConfig(config, world_size)
    dtype = torch.half if parsed.fp16.enabled else torch.bfloat16 if parsed.bf16.enabled else None
    offload = parsed.zero_optimization.offload_param
    if offload is None:
        return dtype, None, None, parsed
    return dtype, offload.device, getattr(offload, "pin_memory", False), parsed


def param_swapper_for(config, remote_device, global_rank=None):
    """The NVMe parameter swapper a parsed DeepSpeed config asks for (None unless nvme)."""
    if remote_device != "nvme":
        return None
    offload = config.zero_optimization.offload_param if config is not None else None
    if offload is None or not offload.nvme_path:
        raise ConfigError("remote_device 'nvme' keeps parameter shards in files under "
                          "zero_optimization.offload_param.nvme_path; add \"offload_param\": "
                          "{\"device\": \"nvme\", \"nvme_path\": ...} to the DeepSpeed config")
    from zero.offload.param_swapper import ParamSwapper
    if global_rank is None:
        import torch.distributed as dist
        global_rank = dist.get_rank() if dist.is_initialized() else 0
    return ParamSwapper.for_path(offload.nvme_path, config.aio, global_rank,
                                 offload.buffer_count, offload.buffer_size, offload.max_in_cpu,
                                 offload.pin_memory)


class Init:
    """Partition parameters as modules are constructed (DeepSpeed's `zero.Init`).

        with zero.Init(data_parallel_group=mpu.get_data_parallel_group(), config=ds_config):
            model = GPT2Model(...)

    Each submodule initialises its own parameters in full, as it would without Init; its
    direct parameters are partitioned as soon as its parent's `__init__` returns (the parent
    may still initialise them, e.g. Megatron's Embedding fills position_embeddings), or at the
    end of the context. So values equal a model built without Init under the same seed, and a
    rank holds at most about one module's children in full (one transformer layer, not the
    model). Initialisation that touches grandchildren's parameters after they were built must
    use GatheredParameters(modifier_rank=0). `module=` partitions an already built model.

    `dtype` (default: fp16/bf16 from the config, else the parameter's dtype) is the dtype of the
    partitions. `remote_device`: "none" keeps partitions on the compute device, "cpu" in host
    memory (pinned with pin_memory on CUDA machines), "nvme" in swap files under the config's
    offload_param.nvme_path (so a model larger than memory is built: each submodule is whole
    only until its parent's __init__ returns). Default: the config's offload_param device.
    """

    _stack = []  # active Init contexts, innermost last
    _patched = {}  # class -> its original __init__

    def __init__(self, module=None, data_parallel_group=None, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True,
                 dtype=None, mpu=None):
        self.enabled = enabled
        if not enabled:
            return
        if config_dict_or_path is not None and config is not None:
            raise ConfigError("zero.Init got both config_dict_or_path= and config=; pass one")
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        init_distributed()  # a script may build its model before zero.initialize starts it
        self.comm = Communicator(data_parallel_group)
        config = config if config is not None else config_dict_or_path
        config_dtype, config_device, config_pin, parsed = (None, None, None, None) \
            if config is None else _init_settings(config, self.comm.world_size)
        self.dtype = dtype or config_dtype
        self.remote_device = normalize_remote_device(
            remote_device if remote_device is not None else config_device)
        self.pin_memory = pin_memory or bool(config_pin)
        self.swapper = param_swapper_for(parsed, self.remote_device)
        self._outermost = False
        if module is not None:
            self.partition(module)

    def partition(self, module, recurse=True):
        partition_module(module, self.comm, self.remote_device, self.pin_memory, self.dtype,
                         recurse=recurse, swapper=self.swapper)

    def module_built(self, module):
        """A module's __init__ finished: partition its children's direct parameters; its own
        wait for its parent's __init__ (which may still initialise them, as Megatron's
        Embedding does for position_embeddings) or for the end of the context."""
        for child in module.children():
            self.partition(child, recurse=False)
            self._waiting.pop(child, None)
        self._waiting[module] = None

    def __enter__(self):
        if not self.enabled:
            return self
        if not Init._stack:
            _patch_module_classes()
        Init._stack.append(self)
        # Built modules whose parameters are still whole, in construction order: every rank
        # must partition (broadcast) them in the same order, which a WeakSet's is not.
        self._waiting = weakref.WeakKeyDictionary()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        Init._stack.remove(self)
        if not Init._stack:
            _unpatch_module_classes()
        if exc[0] is None:
            for module in list(self._waiting):  # roots and modules never attached
                self.partition(module, recurse=False)
        self._waiting = weakref.WeakKeyDictionary()
        return False


def _after_module_init(module):
    if Init._stack:
        Init._stack[-1].module_built(module)


def _wrap_init(original):
    @functools.wraps(original)
    def init_then_partition(module, *args, **kwargs):
        depth = module.__dict__.get("_zero_init_depth", 0)
        object.__setattr__(module, "_zero_init_depth", depth + 1)
        try:
            original(module, *args, **kwargs)
        finally:
            if depth:
                object.__setattr__(module, "_zero_init_depth", depth)
            else:
                module.__dict__.pop("_zero_init_depth", None)
        if depth == 0:  # the most-derived __init__ of this module has finished
            _after_module_init(module)
    init_then_partition._zero_original = original
    return init_then_partition


def _wrap_class(cls):
    original = cls.__dict__.get("__init__")
    if cls in Init._patched or original is None or not inspect.isfunction(original):
        return
    Init._patched[cls] = original
    cls.__init__ = _wrap_init(original)


def _all_subclasses(cls):
    seen, stack = [], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.append(sub)
            stack.extend(sub.__subclasses__())
    return seen


_original_init_subclass = nn.Module.__dict__.get("__init_subclass__")


def _init_subclass_while_active(cls, **kwargs):
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_class(cls)  # classes defined inside the context are partitioned too


def _patch_module_classes():
    for cls in _all_subclasses(nn.Module):
        _wrap_class(cls)
    nn.Module.__init_subclass__ = classmethod(_init_subclass_while_active)


def _unpatch_module_classes():
    for cls, original in Init._patched.items():
        cls.__init__ = original
    Init._patched.clear()
    if _original_init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _original_init_subclass
