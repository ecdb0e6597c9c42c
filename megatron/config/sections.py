"""The resolved training configuration: one frozen dataclass per concern.

Field names are the Megatron flag names (`--num-layers` -> `num_layers`), so the flat view
(`TrainConfig.as_flat_dict`) is the `args` dict Megatron checkpoints record. Every value is
final: defaults derived from other flags, what `--load`'s checkpoint supplied and what the
DeepSpeed JSON decides are already in. `megatron/config/resolve.py` builds it; nothing writes
to it afterwards.
"""

import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple

from megatron.config.batch_rampup import BatchRampup


@dataclass(frozen=True)
class ModelConfig:
    """The GPT-2 architecture (`megatron.model.GPTConfig` is derived from it with the vocab)."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    make_vocab_size_divisible_by: int
    layernorm_epsilon: float
    init_method_std: float
    attention_dropout: float
    hidden_dropout: float
    memory_centric_tiled_linear: bool
    tile_factor: int


@dataclass(frozen=True)
class RecomputeOptions:
    """Where zero.checkpointing keeps the checkpointed inputs (its `configure` keywords)."""
    partition_activations: bool
    checkpoint_in_cpu: bool
    contiguous_checkpointing: bool
    num_checkpoints: int
    synchronize: bool
    profile: bool


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    checkpoint_activations: bool
    checkpoint_num_layers: int
    split_transformers: bool
    # None: Megatron's recompute (mpu.checkpoint); else DeepSpeed's (zero.checkpointing)
    deepspeed_activation_checkpointing: Optional[RecomputeOptions]
    notes: Tuple[str, ...]  # one-line notes printed by rank 0 at start-up


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[Tuple[str, ...]]  # --data-path's values (megatron/data/blend.py)
    train_data_path: Optional[Tuple[str, ...]]  # or each split's own (None: no such split)
    valid_data_path: Optional[Tuple[str, ...]]
    test_data_path: Optional[Tuple[str, ...]]
    train_data: Optional[str]
    data_impl: str
    mmap_warmup: bool
    split: str
    seq_length: int
    tokenizer_type: str
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tokenizer_model: Optional[str]
    num_workers: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool

    @property
    def split_data_paths(self):
        """(train, valid, test) data paths of their own, or None: --data-path cut by --split."""
        if self.train_data_path is None:
            return None
        return (self.train_data_path, self.valid_data_path, self.test_data_path)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and the learning-rate schedule (a DeepSpeed JSON may replace either)."""
    lr: float
    min_lr: float
    weight_decay: float
    clip_grad: float  # 0: no clipping
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    lr_decay_style: str
    # the schedule's lengths, in `schedule_unit`: "iterations", or "samples" under
    # --rampup-batch-size (where an iteration's samples change, as Megatron-LM counts them)
    lr_decay_steps: int
    warmup_steps: int | float  # a --warmup fraction's may be fractional, as in Megatron-LM
    schedule_unit: str
    lr_wsd_decay_steps: Optional[int]  # --lr-decay-style WSD's decay length, else None
    lr_wsd_decay_style: str
    override_lr_scheduler: bool
    use_checkpoint_lr_scheduler: bool
    # lengths derived from --train-iters (no --lr-decay-iters / --warmup-iters given), as the
    # AnnealingLR state keys "end_iter" / "warmup_iter"
    schedule_follows_train_iters: tuple
    cpu_optimizer: bool
    cpu_torch_adam: bool
    # "adam", "adam8bit" or "adam4bit" (when the DeepSpeed JSON has no optimizer section)
    optimizer: str


@dataclass(frozen=True)
class PrecisionConfig:
    fp16: bool
    bf16: bool

    @property
    def params_dtype(self):
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"

    @property
    def torch_dtype(self):
        import torch  # here, not at the top: flags are checked before torch is imported
        return getattr(torch, self.params_dtype)


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout and what the processes run on."""
    world_size: int
    model_parallel_size: int
    data_parallel_size: int
    pipeline_model_parallel_size: int
    num_layers_per_virtual_pipeline_stage: Optional[int]  # interleaved 1F1B when set
    virtual_pipeline_model_parallel_size: int  # model chunks per stage (1: plain 1F1B)
    distributed_backend: Optional[str]  # None: nccl on CUDA, gloo on CPU
    device: str
    local_rank: Optional[int]
    distributed_timeout_minutes: float
    threads: Optional[int]
    DDP_impl: str  # without --deepspeed: "local" (the engine's stage 0 buckets) or "torch"
    ddp_bucket_size: float  # MB per all-reduce bucket, without --deepspeed
    seed: int


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int  # micro batch per data-parallel rank
    global_batch_size: int
    num_micro_batches: int
    train_iters: int
    exit_interval: Optional[int]
    eval_iters: int
    eval_interval: int
    exit_signal_handler: bool
    exit_duration_in_mins: Optional[float]
    kill_switch_file: Optional[str]  # its existence stops the run (saving) at an iteration end
    max_nan_iterations: int
    # compare the data-parallel replicas' weights every N iterations (None: never)
    check_weight_hash_across_dp_replicas_interval: Optional[int]
    # --rampup-batch-size START INCREMENT SAMPLES; None: the batch is constant
    rampup_batch_size: Optional[Tuple[int, int, int]] = None
    manual_gc: bool = False  # Python's collector off while training; the loop collects
    manual_gc_interval: int = 0  # after every N-th iteration (0: never during training)
    manual_gc_eval: bool = True  # and before and after each evaluation
    empty_unused_memory_level: int = 0  # torch.cuda.empty_cache(): 1 per step, 2 twice

    @functools.cached_property
    def rampup(self):
        """The BatchRampup to --global-batch-size, or None."""
        return None if self.rampup_batch_size is None else \
            BatchRampup(*self.rampup_batch_size, final=self.global_batch_size)

    def global_batch_at(self, consumed_samples):
        """The global batch of the iteration that starts after `consumed_samples`."""
        return self.global_batch_size if self.rampup is None \
            else self.rampup.global_batch_at(consumed_samples)

    def micro_batches_in(self, global_batch):
        """Micro batches per data-parallel rank in a global batch of that many samples."""
        return global_batch // (self.global_batch_size // self.num_micro_batches)

    def samples_after(self, iterations):
        """The samples the first `iterations` iterations consume."""
        return iterations * self.global_batch_size if self.rampup is None \
            else self.rampup.samples_after(iterations)


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    save_interval: Optional[int]
    load: Optional[str]
    load_step: Optional[int]  # --ckpt-step: this iteration, not the one the tracker names
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    keep_last_n_checkpoints: Optional[int]


@dataclass(frozen=True)
class TensorboardScalars:
    """What goes to TensorBoard besides the log line's numbers (Megatron-LM's flags)."""
    log_interval: Optional[int] = None  # the iteration's numbers every N; None: with the line
    queue_size: int = 1000
    learning_rate: bool = True
    loss_scale: bool = True
    batch_size: bool = False
    world_size: bool = False
    memory: bool = False
    phase_times: bool = False
    optimizer_states: bool = False  # Adam's moments' and the weights' norms (a collective)


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: Optional[str]
    log_dir: Optional[str]  # metrics.jsonl
    phase_times: bool = False  # the engine times its phases (wall_clock_breakdown): print them
    timing_log_option: str = "minmax"  # the phase times over ranks: max, minmax or all
    params_norm: bool = False  # the weights' norm on the log line (a collective)
    num_zeros_in_grad: bool = False  # zeros in each step's gradient (a collective in the step)
    tensorboard: TensorboardScalars = TensorboardScalars()


@dataclass(frozen=True)
class ProfilerConfig:
    """--profile: torch.profiler over iterations `profile_first` to `profile_last`."""
    profile: bool = False
    profile_first: int = 0
    profile_last: int = 0
    profile_ranks: Tuple[int, ...] = ()
    profile_with_stack: bool = False  # --profile pt-full
    profile_trace_dir: Optional[str] = None


@dataclass(frozen=True)
class EngineConfig:
    """The zero engine both trainers run on. `ds_config` is the typed DeepSpeed config: the
    user's JSON under --deepspeed, else the ZeRO stage 0 config the Megatron flags describe."""
    deepspeed: bool  # DeepSpeed's checkpoint layout and JSON; else Megatron's
    deepspeed_config: Optional[str]  # the JSON file given, for messages and checkpoints
    ds_config: Any  # zero.config.deepspeed_config.DeepSpeedConfig
    remote_device: Optional[str]  # stage 3: where zero.Init keeps the partitions
    use_pin_memory: bool

    @property
    def zero_stage(self):
        return self.ds_config.zero_optimization.stage


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    activation_checkpointing: ActivationCheckpointConfig
    data: DataConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    engine: EngineConfig
    profiler: ProfilerConfig = ProfilerConfig()
    notes: Tuple[str, ...] = ()  # what resolution took from elsewhere, printed at start-up
    # flags an extra_args_provider added (Megatron's hook for custom scripts)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def as_flat_dict(self):
        """Every plain value under its flag name: the `args` dict checkpoints record."""
        flat = {}
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if dataclasses.is_dataclass(value):
                flat.update(_plain_fields(value))
        flat["params_dtype"] = self.precision.params_dtype
        flat["zero_stage"] = self.engine.zero_stage
        return flat


def _plain_fields(section):
    plain = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is None or isinstance(value, (bool, int, float, str)):
            plain[f.name] = value
        elif isinstance(value, tuple) and f.name != "notes" and \
                all(isinstance(v, (bool, int, float, str)) for v in value):
            plain[f.name] = list(value)  # (--data-path's values)
        elif dataclasses.is_dataclass(value) and f.name != "ds_config":
            plain.update(_plain_fields(value))
    if isinstance(section, ActivationCheckpointConfig):
        plain["deepspeed_activation_checkpointing"] = \
            section.deepspeed_activation_checkpointing is not None
    return plain
