"""Storage faults however the libraries report them, as the OSError they are.

A full disk while orbax saves reaches linjax as tensorstore's `ValueError("RESOURCE_EXHAUSTED: ...
No space left on device [os_error_code='28']")`, often wrapped by orbax in a bare `Exception`, and
the sibling writes that failed the same way are logged by asyncio ("Task exception was never
retrieved", a traceback each) when their tasks are collected. `os_error` finds the operating
system's error inside such an exception (its errno and file), so that the `linjax` command reports
it as one line, like any OSError; `quiet_async_storage_errors` drops asyncio's copies of it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys

# tensorstore names the operating system's error number and the file it was writing or reading.
_ERRNO = re.compile(r"os_error_code='?(\d+)")
_FILE = re.compile(r'(?:Failed writing|Failed reading|Error writing local file|Error reading local file|'
                   r'local file) "([^"]+)"')
# Messages of errors with no errno that mean a storage fault all the same.
_KNOWN = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}


# tensorstore's messages start with an absl status code.
_STATUS = re.compile(r"^[A-Z_]+: ")


def os_error(err: BaseException) -> OSError | None:
    """The OSError that `err` is, or wraps (tensorstore's and orbax's messages included); None if it is
    no storage fault. Only orbax's bare `Exception` is looked through to its cause: any other error's
    own message says what happened."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        text = str(err)
        code = _ERRNO.search(text)
        number = int(code.group(1)) if code else None
        if number is None and _STATUS.match(text):
            number = next((n for message, n in _KNOWN.items() if message in text), None)
        if number:
            where = _FILE.search(text)
            return OSError(number, os.strerror(number), where.group(1) if where else None)
        if type(err) is not Exception:
            return None
        err = err.__cause__
    return None


class _DropStorageFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exception = record.exc_info[1] if record.exc_info else None
        if exception is not None and os_error(exception) is not None:
            return False
        return not _ERRNO.search(record.getMessage())


def _closed_loop(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def quiet_async_storage_errors() -> None:
    """Drops the logs of background work that failed on a storage fault (asyncio's tasks, orbax's save
    threads through absl): the same fault is raised where the save waits for them, and reported there once.
    Also tensorstore's completion callbacks of the failed save's other writes, which land on event loops
    orbax has already closed ("Event loop is closed", reported as unraisable): nothing waits for them."""
    for name in ("asyncio", "absl"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStorageFaults) for f in logger.filters):
            logger.addFilter(_DropStorageFaults())
    previous = sys.unraisablehook
    if getattr(previous, "__name__", "") != "_unless_closed_loop":
        def _unless_closed_loop(unraisable):
            if not _closed_loop(unraisable):
                previous(unraisable)

        sys.unraisablehook = _unless_closed_loop
