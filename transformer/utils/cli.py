"""What the command-line apps share: a user's mistake ends the run with one line on stderr and exit
status 2, never a traceback."""

from __future__ import annotations

import sys
from typing import NoReturn


def exit_with_error(error: BaseException) -> NoReturn:
    """`error: <the first line of the message>` on stderr, exit status 2."""
    message = str(error).strip().splitlines()
    print(f"error: {message[0] if message else type(error).__name__}", file=sys.stderr)
    sys.exit(2)
