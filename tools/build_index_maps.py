"""Build the GPT-2 dataset index maps ahead of a training job, from the job's own flags.

    python tools/build_index_maps.py --world-size 64 <the pretrain_gpt2.py flags of the job>

A training start builds `{prefix}_{train,valid,test}_indexmap_*.npy` on rank 0 while every
other rank waits (minutes for a big corpus).  Run this once, on a login node, with the same
flags as the job (--data-path or --train-data, --split, --seq-length, --seed, --train-iters,
--batch-size/--global-batch-size, --eval-interval, --eval-iters, ...) and the job's world size:
the job then finds the maps cached and starts at once.  The sample counts come from the same
code as training's, so the file names match.  --train-data corpora are tokenized too.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import run_cli  # noqa: E402


def add_world_size(parser):
    group = parser.add_argument_group("index maps ahead of time")
    group.add_argument("--world-size", type=int, default=None,
                       help="the job's number of processes (decides the global batch when "
                            "--global-batch-size is not given); default: the launcher's, or 1")
    return parser


def build(argv=None):
    from megatron.config import resolve_config
    from megatron.data.gpt2_dataset import build_index_mappings_only
    from megatron.errors import ConfigError
    from megatron.training.pretrain import num_samples_per_split
    world_size = _world_size_flag(argv)
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    config = resolve_config(argv, extra_args_provider=add_world_size,
                            defaults={"tokenizer_type": "GPT2BPETokenizer"},
                            world_size=world_size)
    data, seed = config.data, config.parallel.seed
    data_path = data.data_path
    if data.train_data is not None:
        from megatron.data.corpora import corpus_data_prefix
        from megatron.tokenizer import build_tokenizer
        tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file,
                                    data.tokenizer_model)
        data_path = corpus_data_prefix(data.train_data, tokenizer)
    samples = num_samples_per_split(config)
    start = time.perf_counter()
    paths = build_index_mappings_only(data_path, data.split, samples, data.seq_length, seed,
                                      split_data_paths=data.split_data_paths)
    print(f" > index maps for {samples[0]} train / {samples[1]} valid / {samples[2]} test "
          f"samples of {data.seq_length} tokens (seed {seed}) ready in "
          f"{time.perf_counter() - start:.2f} s:", flush=True)
    for path in paths:
        print(f"   {path}", flush=True)
    return paths


def _world_size_flag(argv):
    """--world-size N (or =N) from argv, read before the full parse that depends on it."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--world-size=") else \
            argv[i + 1] if arg == "--world-size" and i + 1 < len(argv) else None
        if value is not None:
            try:
                return int(value)
            except ValueError:
                from megatron.errors import ConfigError
                raise ConfigError(f"--world-size takes an integer, got {value!r}") from None
    return None


def main(argv=None):
    return run_cli(build, argv)


if __name__ == "__main__":
    sys.exit(main())
