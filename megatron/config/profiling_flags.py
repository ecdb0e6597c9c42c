"""Megatron-LM's profiling and garbage-collector flags: --profile (torch.profiler over the
iterations after --profile-step-start up to --profile-step-end, on --profile-ranks; the
Chrome trace goes to --tensorboard-dir), and --manual-gc (Python's collector off during
training, run by the loop every --manual-gc-interval iterations and around evaluation, so
that no rank pauses for it while the others wait in a collective), and
--empty-unused-memory-level (CUDA's cached blocks handed back each iteration). Defined for the
parser
and resolved into the frozen ProfilerConfig and TrainingConfig's collector fields.
"""

from megatron.config.sections import ProfilerConfig
from megatron.errors import ConfigError, require


def add_profiling_flags(parser):
    g = parser.add_argument_group("profiling and the garbage collector")
    g.add_argument("--profile", nargs="?", const="pt", default=None, choices=("pt", "pt-full"),
                   help="profile iterations --profile-step-start + 1 to --profile-step-end "
                        "(the log line's numbers) with torch.profiler on --profile-ranks: a "
                        "Chrome trace (rank<R>.iterations_<A>-<B>.pt.trace.json.gz, for "
                        "https://ui.perfetto.dev) in --tensorboard-dir (else --log-dir, else "
                        "--save), and the top ops by time in the log. 'pt-full' "
                        "(Megatron-DeepSpeed's value) adds each op's Python stack")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="the iteration after which profiling starts (Megatron-LM's)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="the last iteration profiled")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], metavar="RANK",
                   help="the global ranks that profile (default: 0)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collector off for training and "
                        "collect at fixed iterations instead (--manual-gc-interval), the same "
                        "on every rank: an automatic collection on one rank stalls every rank "
                        "waiting for it in a collective")
    g.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="with --manual-gc: collect after every N-th iteration (0: only when "
                        "training starts and around evaluation)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: do not collect before and after each evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=(0, 1, 2),
                   help="hand the CUDA caching allocator's unused memory back to the device: "
                        "1 before each optimizer step and after each evaluation batch, 2 after "
                        "each optimizer step too (with pipeline stages both act once, after "
                        "the step; Megatron-LM's; slower, for a run near the memory limit "
                        "that fragments)")


_PROFILE_ONLY = {"profile_step_start": "--profile-step-start",
                 "profile_step_end": "--profile-step-end", "profile_ranks": "--profile-ranks"}
_GC_ONLY = {"manual_gc_interval": "--manual-gc-interval", "manual_gc_eval": "--no-manual-gc-eval"}


def resolve_profiler(raw, given, world_size, log_dir, train_iters):
    """(the ProfilerConfig of the parsed flags `raw` (`given`: those on the command line), the
    notes it leaves). The trace goes to --tensorboard-dir, else `log_dir` (metrics.jsonl's:
    --log-dir, else --save)."""
    _needs(raw["profile"], given, _PROFILE_ONLY, "--profile")
    if raw["profile"] is None:
        return ProfilerConfig(), ()
    start, end = raw["profile_step_start"], raw["profile_step_end"]
    require(start >= 0, f"--profile-step-start must be 0 or more, got {start}")
    require(end > start, f"--profile-step-end {end} must be after --profile-step-start {start}: "
                         "iterations start + 1 to end are profiled")
    outside = [rank for rank in raw["profile_ranks"] if not 0 <= rank < world_size]
    require(not outside, f"--profile-ranks {' '.join(map(str, outside))}: not a rank of this "
                         f"job (ranks 0 to {world_size - 1})")
    trace_dir = raw["tensorboard_dir"] or log_dir
    require(trace_dir, "--profile writes a trace: give --tensorboard-dir (or --log-dir or "
                       "--save) for it")
    notes = ()
    if end > train_iters:
        notes = (f" note: --profile-step-end {end} is after the run's last iteration "
                 f"{train_iters}: " + (f"iterations {start + 1} to {train_iters} are profiled"
                                       if start < train_iters else "nothing is profiled"),)
    return ProfilerConfig(profile=True, profile_first=start + 1, profile_last=end,
                          profile_ranks=tuple(sorted(set(raw["profile_ranks"]))),
                          profile_with_stack=raw["profile"] == "pt-full",
                          profile_trace_dir=trace_dir), notes


def manual_gc_fields(raw, given):
    """TrainingConfig's collector fields of the parsed flags."""
    _needs(raw["manual_gc"], given, _GC_ONLY, "--manual-gc")
    require(raw["manual_gc_interval"] >= 0,
            f"--manual-gc-interval must be 0 (never during training) or more, got "
            f"{raw['manual_gc_interval']}")
    return {"manual_gc": raw["manual_gc"], "manual_gc_interval": raw["manual_gc_interval"],
            "manual_gc_eval": raw["manual_gc_eval"]}


def empty_cache_notes(raw, on_cuda):
    """--empty-unused-memory-level on the CPU: said to do nothing."""
    level = raw["empty_unused_memory_level"]
    if not level or on_cuda:
        return ()
    return (f" note: --empty-unused-memory-level {level} empties CUDA's caching allocator; "
            "this run is on the CPU, where it does nothing",)


def _needs(switch, given, flags, switch_flag):
    lonely = [flag for dest, flag in flags.items() if dest in given]
    if lonely and not switch:
        raise ConfigError(f"{', '.join(lonely)} {'do' if len(lonely) > 1 else 'does'} nothing "
                          f"without {switch_flag}")
