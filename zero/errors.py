"""User-facing error types of the zero engine.

Everything a user can get wrong (a DeepSpeed JSON key, a batch size that does not divide, a
checkpoint that does not fit) is raised as a `ZeroError`. Entry points catch it and print only
the message, which says what was wrong, where, and what to do. Programming errors keep their
tracebacks. zero never imports megatron, so it has its own hierarchy.
"""


class ZeroError(Exception):
    """Base class for errors caused by user input, printed without a traceback."""


class ConfigError(ZeroError):
    """A DeepSpeed config (JSON file, dict, base64 string) or flag that is invalid."""


class CheckpointError(ZeroError):
    """A checkpoint that is missing, incomplete, or does not match the engine."""


class CallError(ZeroError):
    """A call that every rank must make (a checkpoint save or load) made on some ranks only."""
