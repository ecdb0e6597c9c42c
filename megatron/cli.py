"""Entry-point helper: user mistakes print one `error:` line, programming errors a traceback."""

import sys

from megatron.errors import MegatronError

USER_ERROR_EXIT_CODE = 2


def run_cli(main, *args, **kwargs):
    """Call `main(*args, **kwargs)`; a MegatronError becomes `error: ...` and exit code 2."""
    try:
        main(*args, **kwargs)
    except MegatronError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    return 0
