"""Bad input versus bugs: what a command or node start-up reports as one line.

`InputError` is raised for files a user hands us that cannot be used (model cards,
checkpoints, bags); its message names the file and what is wrong. `one_line_errors` turns
it, and the other errors that mean bad input (`INPUT_ERRORS`), into a single
`<prog>: error: <message>` line on stderr and a non-zero exit, so a typo never prints a
traceback; `--debug` (the `tta` command) or TTA_DEBUG=1 (node entry points) re-raises
instead. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEBUG_ENV = "TTA_DEBUG"


class InputError(ValueError):
    """A file or value given to us cannot be used; the message names it and why."""


# errors that mean "the input is bad" (a ValueError is how tta_core validation reports)
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def debug_requested() -> bool:
    """Whether TTA_DEBUG asks for tracebacks (any value but '', '0')."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (whitespace runs, newlines included, collapse)."""
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def one_line_errors(prog: str, debug: bool = False,
                    extra: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Exit with `<prog>: error: <message>` for INPUT_ERRORS (+ `extra`); re-raise them
    as they are when `debug` or TTA_DEBUG is set."""
    try:
        yield
    except (*INPUT_ERRORS, *extra) as exc:
        if debug or debug_requested():
            raise
        raise SystemExit(f"{prog}: error: {one_line(exc)}") from None


#: stat file type test -> what a path that is not a regular file is, for messages
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"))


def require_file(path: str | Path, what: str, missing: str) -> None:
    """Nothing when `path` is a regular file (or a link to one); FileNotFoundError(`missing`)
    when nothing is there; InputError '<what> is not a regular file (a character device)'
    when something else is (/dev/zero, a directory, a FIFO: reading those hangs, fills
    memory or fails far from the cause)."""
    path = Path(path)
    if path.is_file():
        return
    try:
        mode = path.stat().st_mode
    except OSError:  # nothing there, or a link to nothing
        raise FileNotFoundError(missing) from None
    kind = next((k for test, k in _FILE_KINDS if test(mode)), "not a file")
    raise InputError(f"{what} is not a regular file ({kind})")
