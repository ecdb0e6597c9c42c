"""`python -m megatron.config.check_flags ARGS...`: exit 0 when ARGS are pretrain_gpt2.py
flags with values of the right type (and `--split` a valid split); else the error, exit 2.

The launch scripts pass their extra arguments here before preparing data, so a typo costs a
second instead of minutes of corpus download, tokenizer training and preprocessing. Whether
the flags agree with each other is pretrain_gpt2.py's own check, once all of them are known.
"""

import sys

from megatron.cli import run_cli
from megatron.config.flags import build_parser
from megatron.config.command_line import parse_command_line
from megatron.data.splits import parse_splits


def check(argv):
    parser = build_parser()
    parser.prog = "pretrain_gpt2.py"  # whose flags they are, in argparse's usage and error
    _, raw = parse_command_line(parser, argv)
    parse_splits(raw["split"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_cli(check, argv)


if __name__ == "__main__":
    sys.exit(main())
