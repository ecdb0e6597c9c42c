"""Shuffle the lines of a loose JSON corpus, out of core and deterministically (--seed).

    python tools/openwebtext/shuffle_jsons.py deduped.json train_data.json --seed 1234 \
        [--workers 4]

Lines go to temporary buckets of about --bucket-mb MB drawn from a seeded RNG; each bucket is
then shuffled in memory (in --workers processes) and the buckets are appended in order.  Memory
holds one bucket per worker.  The order depends on the seed and the input size only.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.errors import ConfigError  # noqa: E402
from tools.openwebtext.external import add_bucket_arg, bucket_bytes, shuffle_lines  # noqa: E402
from tools.openwebtext.streaming import StageReport, input_files, stage_main  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--seed", type=int, default=1234)
    add_bucket_arg(parser, "shuffle")
    parser.add_argument("--workers", type=int, default=1)
    return parser.parse_args(argv)


def run(args, stream=None):
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    buckets = bucket_bytes(args)
    path = input_files([args.input])[0]
    lines, seconds = shuffle_lines(path, args.output, args.seed, args.workers, buckets)
    size = os.path.getsize(args.output)
    return StageReport("shuffle_jsons", read=lines, kept=lines, bytes_in=os.path.getsize(path),
                       bytes_out=size, seconds=seconds)


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
