"""The logging flags: Megatron-LM's log line and timers (--log-interval, --timing-log-level,
--timing-log-option), metrics.jsonl (--log-dir) and what TensorBoard gets (--tensorboard-dir,
--log-timers-to-tensorboard, --tensorboard-log-interval, the --log-*-to-tensorboard flags,
--log-params-norm, --log-num-zeros-in-grad): defined for the parser and resolved into the
frozen LoggingConfig.
"""

from megatron.config.megatron_flags import offered_here
from megatron.config.sections import LoggingConfig, TensorboardScalars
from megatron.errors import ConfigError

# a value other Megatron-LMs offer -> what this trainer offers instead
_TIMING_LEVELS = {"2": "Megatron-LM's level 2 adds finer timers (the pipeline's sends and "
                       "receives, compute per micro batch) that this trainer does not have: "
                       "give 1 (forward, backward, optimizer and batch generator)"}


def add_logging_flags(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-dir", default=None,
                   help="where metrics.jsonl goes (default: --tensorboard-dir, else --save)")
    g.add_argument("--timing-log-level", type=offered_here(_TIMING_LEVELS, int),
                   choices=(0, 1), default=0,
                   help="1: each log line is followed by the time per phase over the ranks "
                        "(--timing-log-option), ' (min, max) time across ranks (ms) | "
                        "forward: (..., ...) | backward: ... | optimizer: ... | batch "
                        "generator: ...' (per iteration, over the interval; the engine's "
                        "wall_clock_breakdown, which synchronises a GPU after each phase). "
                        "0: none. Also on when a --deepspeed config sets "
                        "\"wall_clock_breakdown\": true")
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax",
                   help="how the timers line shows each phase over the job's ranks: max (the "
                        "slowest rank's time), minmax (the fastest and the slowest rank's), "
                        "all (every rank's, one line per phase). metrics.jsonl's phase_ms and "
                        "TensorBoard have the maximum; minmax adds phase_ms_min, all "
                        "phase_ms_by_rank. Needs the timers on (--timing-log-level 1)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the phase times to TensorBoard too, as '<phase>-time' (the "
                        "maximum over ranks; turns them on, as --timing-log-level 1)")
    g.add_argument("--log-params-norm", action="store_true",
                   help="the log line, metrics.jsonl (params_norm) and TensorBoard "
                        "(params-norm) get the L2 norm of the trained weights, from their fp32 "
                        "master copies over every parallel rank (a collective at each log "
                        "line)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="the log line, metrics.jsonl (num_zeros_in_grad) and TensorBoard "
                        "(num-zeros) get the number of zero elements in the step's gradient, "
                        "over every parallel rank, each element once (a collective inside "
                        "each step); none for a skipped step")
    g.add_argument("--tensorboard-log-interval", type=int, default=None, metavar="N",
                   help="write the iteration's numbers to TensorBoard every N iterations, "
                        "each of that iteration alone (lm-loss, learning-rate, loss-scale, "
                        "grad-norm and the ones the --log-*-to-tensorboard flags add, each "
                        "also 'vs samples'), as Megatron-LM does; by default they go with the "
                        "log line, the loss averaged over the interval. ms-per-iteration, "
                        "tokens-per-s, mfu and the phase times go with the log line either "
                        "way")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000, metavar="N",
                   help="TensorBoard events held in memory before they are written out")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="TensorBoard gets the global batch size (batch-size)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="TensorBoard gets the number of processes (world-size)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="TensorBoard gets rank 0's memory: on a GPU the caching allocator's "
                        "mem-reserved-bytes, mem-allocated-bytes and mem-allocated-count, on a "
                        "CPU the process's mem-rss-bytes and mem-max-rss-bytes")
    g.add_argument("--log-optimizer-states-to-tensorboard", action="store_true",
                   help="TensorBoard gets the L2 and L1 norms and the largest magnitude of "
                        "Adam's moments and of the fp32 weights, as Megatron-DeepSpeed names "
                        "them (optimizer/variance_l2, variance_sqrt_l2, momentum_l2, "
                        "weight_l2, the same as _l1 and _abs_max), each element once over "
                        "every parallel rank (a collective where TensorBoard is written)")
    g.add_argument("--no-log-learning-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard",
                   help="leave the learning rate out of TensorBoard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard",
                   help="leave the loss scale out of TensorBoard")


# TensorBoard-only flags (dest -> flag): each needs --tensorboard-dir
_TENSORBOARD_FLAGS = {
    "log_timers_to_tensorboard": "--log-timers-to-tensorboard",
    "tensorboard_log_interval": "--tensorboard-log-interval",
    "tensorboard_queue_size": "--tensorboard-queue-size",
    "log_batch_size_to_tensorboard": "--log-batch-size-to-tensorboard",
    "log_world_size_to_tensorboard": "--log-world-size-to-tensorboard",
    "log_memory_to_tensorboard": "--log-memory-to-tensorboard",
    "log_optimizer_states_to_tensorboard": "--log-optimizer-states-to-tensorboard",
    "log_learning_rate_to_tensorboard": "--no-log-learning-rate-to-tensorboard",
    "log_loss_scale_to_tensorboard": "--no-log-loss-scale-to-tensorboard",
}


def resolve_logging(raw, given, ds_config):
    """The LoggingConfig of the parsed flags `raw` (`given`: those on the command line);
    the engine config `ds_config` says whether the phase timers run."""
    phase_times = ds_config.wall_clock_breakdown  # the timing flags turned it on
    lonely = [flag for dest, flag in _TENSORBOARD_FLAGS.items() if dest in given]
    if lonely and not raw["tensorboard_dir"]:
        raise ConfigError(f"{', '.join(lonely)} {'need' if len(lonely) > 1 else 'needs'} "
                          "--tensorboard-dir (where TensorBoard is written)")
    for dest in ("tensorboard_log_interval", "tensorboard_queue_size"):
        if raw[dest] is not None and raw[dest] < 1:
            raise ConfigError(f"{_TENSORBOARD_FLAGS[dest]} must be at least 1, got {raw[dest]}")
    if raw["log_optimizer_states_to_tensorboard"]:
        _check_adam_moments(raw, ds_config)
    tensorboard = TensorboardScalars(
        log_interval=raw["tensorboard_log_interval"], queue_size=raw["tensorboard_queue_size"],
        learning_rate=raw["log_learning_rate_to_tensorboard"],
        loss_scale=raw["log_loss_scale_to_tensorboard"],
        batch_size=raw["log_batch_size_to_tensorboard"],
        world_size=raw["log_world_size_to_tensorboard"],
        memory=raw["log_memory_to_tensorboard"], phase_times=raw["log_timers_to_tensorboard"],
        optimizer_states=raw["log_optimizer_states_to_tensorboard"])
    return LoggingConfig(raw["log_interval"], raw["tensorboard_dir"],
                         raw["log_dir"] or raw["tensorboard_dir"] or raw["save"],
                         phase_times=phase_times, timing_log_option=raw["timing_log_option"],
                         params_norm=raw["log_params_norm"],
                         num_zeros_in_grad=raw["log_num_zeros_in_grad"], tensorboard=tensorboard)


def _check_adam_moments(raw, ds_config):
    """--log-optimizer-states-to-tensorboard writes Adam's moments: a DeepSpeed config's
    optimizer without them (SGD, Adagrad) is one error."""
    section = ds_config.optimizer if raw["deepspeed"] else None
    if section is not None and "adam" not in str(section.type).lower():
        raise ConfigError(f"--log-optimizer-states-to-tensorboard writes Adam's moments "
                          f"(exp_avg, exp_avg_sq); the DeepSpeed config's optimizer "
                          f"{section.type!r} keeps none: drop the flag or use an Adam")


def timing_option_note(raw, given, ds_config):
    """--timing-log-option without the timers does nothing (as in Megatron-LM, where level 0
    has no timers to show); a ported command line keeps working, with a note."""
    if "timing_log_option" not in given or ds_config.wall_clock_breakdown:
        return ()
    return (f" note: --timing-log-option {raw['timing_log_option']} does nothing without the "
            "timers: --timing-log-level 1 turns them on",)
