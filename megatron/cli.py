"""Entry-point helper: user mistakes print one `error:` line, programming errors a traceback."""

import sys

from megatron.errors import MegatronError
from zero.errors import ZeroError

USER_ERROR_EXIT_CODE = 2
# The zero engine (behind --deepspeed) never imports megatron, so it has its own user-error base.
USER_ERRORS = (MegatronError, ZeroError)


def run_cli(main, *args, **kwargs):
    """Call `main(*args, **kwargs)`; a user error becomes `error: ...` and exit code 2."""
    try:
        main(*args, **kwargs)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    return 0
