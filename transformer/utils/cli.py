"""What the command-line apps share: warnings on stderr, each a line (and the one line that says which
CPU kernels decoding chose); a user's mistake ends the run with one line on stderr and exit status 2,
never a traceback."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn


def log_to_stderr() -> None:
    """Warnings as `WARNING: message` on stderr; the decoding kernels' choice too."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    logging.getLogger("transformer.kernels.timing").setLevel(logging.INFO)


def exit_with_error(error: BaseException) -> NoReturn:
    """`error: <the first line of the message>` on stderr, exit status 2."""
    message = str(error).strip().splitlines()
    print(f"error: {message[0] if message else type(error).__name__}", file=sys.stderr)
    sys.exit(2)
