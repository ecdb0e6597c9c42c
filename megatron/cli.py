"""Entry-point helper: user mistakes (and paths the user may not write or read) print one
`error:` line, programming errors a traceback, Ctrl-C a line and exit code 130."""

import sys
import time

from megatron.errors import ConfigError, DataError, Interrupted, TokenizerError, user_error_types

USER_ERROR_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 130  # what a shell reports for a process ended by SIGINT
# Errors every rank meets alike (the same flags, files and tokenizer): printed by rank 0 only.
# An error marked `said_elsewhere` says itself whether another rank prints it
# (megatron/runtime/rank_failures.py).
SAME_ON_EVERY_RANK = (ConfigError, DataError, TokenizerError)
RANK0_PRINTS_FIRST_SECONDS = 2.0


def run_cli(main, *args, **kwargs):
    """Call `main(*args, **kwargs)`; a user error becomes `error: ...` and exit code 2."""
    try:
        main(*args, **kwargs)
    except user_error_types() as error:
        said_elsewhere = getattr(error, "said_elsewhere", None)
        if said_elsewhere is None:
            said_elsewhere = _same_on_every_rank(error) and launched_rank() != 0
        if not said_elsewhere:
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank once one exits with an error: the silent ranks give
            # the rank that prints it the moment it needs
            time.sleep(RANK0_PRINTS_FIRST_SECONDS)
        return USER_ERROR_EXIT_CODE
    except PermissionError as error:  # a folder the user pointed at that is not theirs
        path = error.filename if error.filename2 is None else error.filename2
        print(f"error: {error.strerror or 'permission denied'}: {path}: this user cannot "
              f"write (or read) there; give a path it can, or fix the folder's permissions",
              file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt as interrupt:
        message = str(interrupt) if isinstance(interrupt, Interrupted) else "interrupted"
        if message:
            print(message, file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    except Exception as error:
        if not _raised_by_an_interrupt(error):
            raise
        # Ctrl-C inside torch.save: its zip writer fails on the way out ("unexpected pos")
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"interrupted (then, on the way out: {first[:200]})", file=sys.stderr,
              flush=True)
        return INTERRUPTED_EXIT_CODE
    return 0


def _same_on_every_rank(error):
    """(the DeepSpeed config's parse raises zero's own errors, marked; zero's other errors,
    such as an NVMe folder one node lacks, are the rank's)"""
    return isinstance(error, SAME_ON_EVERY_RANK) or getattr(error, "same_on_every_rank", False)


def _raised_by_an_interrupt(error):
    """Whether `error` was raised while a KeyboardInterrupt was being handled."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__context__
    return False


def launched_rank():
    """This process's global rank as its launcher (torchrun, OpenMPI, SLURM) set it; 0 alone
    (or when the launcher's variables are themselves the error being reported)."""
    from megatron.runtime.launch import discover_launch_environment
    try:
        return discover_launch_environment().rank
    except ConfigError:
        return 0
