"""User-facing error types.

Every mistake a user can make (a bad flag, a missing file, a checkpoint that does not fit the
model) is raised as one of these.  Entry points catch `MegatronError` and print only the
message, so users see what went wrong and what to do instead of a traceback.  Programming
errors (anything else) keep their tracebacks.
"""

import sys


class MegatronError(Exception):
    """Base class for errors caused by user input, printed without a traceback."""


class ConfigError(MegatronError):
    """Inconsistent or invalid command-line flags or configuration."""


def require(condition, message):
    """A ConfigError with `message` unless `condition` holds (the flag checks' one form)."""
    if not condition:
        raise ConfigError(message)


class DataError(MegatronError):
    """A data file (corpus, .bin/.idx, index map) is missing, malformed or inconsistent."""


class TokenizerError(MegatronError):
    """Tokenizer files that are missing or do not parse."""


class CheckpointError(MegatronError):
    """A checkpoint that is missing, incomplete, or does not match the model."""


class LaunchError(MegatronError):
    """The processes of a job could not meet (one not started, another world size, an address
    that is not rank 0's): each rank says what it met."""


class TrainingError(MegatronError):
    """Training cannot go on (the loss stays NaN, another rank died or hangs); the message says
    which checkpoint to resume from."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after the trainer stopped cleanly; the message says how to resume."""


def user_error_types():
    """MegatronError, plus the zero engine's ZeroError once zero is loaded (it never imports
    megatron, so it has its own base).  Looked up lazily: importing zero imports torch, which
    would cost the data tools seconds per start and force spawned (not forked) workers."""
    zero_errors = sys.modules.get("zero.errors")
    return (MegatronError,) if zero_errors is None else (MegatronError, zero_errors.ZeroError)
