"""The command line as the user typed it, before its values are checked: Megatron-LM flags
this trainer does not take, later Megatron-LM's --data-path forms and `--flag -1e-3` values
are handled before argparse parses it; a flag given twice gets a note, and an error about a
flag given under another name names it as typed."""

import argparse
import contextlib
import itertools
import re

from megatron.config.megatron_flags import refuse_flags_not_taken
from megatron.errors import ConfigError


@contextlib.contextmanager
def in_the_users_spelling(parser, argv):
    """A ConfigError about a flag given under another name (`--micro-batch-size` for
    `--batch-size`) names the flag as the user wrote it."""
    try:
        yield
    except ConfigError as error:
        message = str(error)
        for action in parser._actions:  # argparse has no public way to reach every action
            typed = [name for name in action.option_strings[1:]
                     if any(arg == name or arg.startswith(name + "=") for arg in argv)]
            if typed:
                message = re.sub(rf"(?<![\w-]){re.escape(action.option_strings[0])}(?![\w-])",
                                 typed[0], message)
        error.args = (message,)
        raise


def parse_command_line(parser, argv):
    """(argv as parsed, its values as a dict). argparse's own errors (an unknown flag, a value
    of the wrong type) are one ConfigError line (flags.py); Megatron-LM flags not taken, which
    it would word misleadingly, are ours."""
    refuse_flags_not_taken(argv, parser)
    several = {name for action in parser._actions if isinstance(action.nargs, int)
               and action.nargs > 1 for name in action.option_strings}
    argv = _split_value_with_a_dash(argv, several)
    return argv, vars(parser.parse_args(argv))


def repeated_flag_notes(parser, argv):
    """A flag given more than once with different values keeps the last (argparse's rule,
    which launch scripts rely on to let the user override their flags): one note each, so a
    forgotten duplicate does not pass unseen."""
    values = {}
    for i, arg in enumerate(argv):
        flag, joined, value = arg.partition("=")
        action = parser._option_string_actions.get(flag)  # argparse's own table
        if not isinstance(action, argparse._StoreAction) or action.nargs in ("?", "*"):
            continue  # not a flag that stores its values (store_true, append)
        if isinstance(action.nargs, int) and not joined:  # (--rampup-batch-size's three)
            value = " ".join(argv[i + 1:i + 1 + action.nargs])
        elif action.nargs == "+" and not joined:  # (--data-path's blend)
            value = " ".join(itertools.takewhile(lambda a: not a.startswith("--"),
                                                 argv[i + 1:]))
        elif not joined:
            value = argv[i + 1] if i + 1 < len(argv) else None
        values.setdefault(action.dest, []).append((flag, value))
    notes = []
    for given in values.values():
        if len({value for _, value in given}) > 1:
            shown = ", then ".join(f"{flag} {value}" for flag, value in given)
            notes.append(f" note: {shown}: the last one is used")
    return tuple(notes)


def _split_value_with_a_dash(argv, several=()):
    """`--split -1,50,1` as `--split=-1,50,1`, `--lr -1e-3` as `--lr=-1e-3`: argparse takes a
    value starting with "-" (other than a plain negative number such as -1 or -0.5) for a flag
    and says "expected one argument"; joined, the value reaches the flag's own check, which
    says what is wrong with it. Not the flags in `several`, which take several values (a
    negative number among them reaches their check as it is)."""
    def negative_value(flag, value):
        if not value.startswith("-") or value.startswith("--"):
            return False
        return flag == "--split" or _is_number(value)
    joined, i = [], 0
    while i < len(argv):
        if argv[i].startswith("--") and "=" not in argv[i] and i + 1 < len(argv) \
                and argv[i] not in several and negative_value(argv[i], argv[i + 1]):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True
