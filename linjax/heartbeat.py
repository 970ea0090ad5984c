"""The heartbeat a watchdog reads, and the temporary files it removes: the core's side of it.

Long loops (training steps, evaluation windows and samples, decode steps, lm-eval forward
passes) call `progress()`; code that makes a temporary file or folder wraps it in
`temporary(path)`. Neither starts a thread or knows what happens on a stall: the watchdog
thread (`linjax.app.watchdog`, started by the `linjax` command) reads `last_progress()` and,
before it ends a stalled process, calls `remove_temporaries()`. Without a watchdog both cost a
clock read and a set update.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

_last_progress = time.monotonic()
_temporaries: set[str] = set()  # files and folders to remove if a watchdog ends the process


def progress() -> None:
    """The running stage has advanced (cheap: call it in inner loops)."""
    global _last_progress
    _last_progress = time.monotonic()


def last_progress() -> float:
    """`time.monotonic()` at the latest `progress()`."""
    return _last_progress


@contextlib.contextmanager
def temporary(path: str):
    """Marks `path` (a temporary file or folder, e.g. an export made only to be evaluated) for removal
    should a watchdog end the process inside the block: `os._exit` runs no `finally` and no
    `TemporaryDirectory` cleanup, so without this a stalled stage would leave it behind."""
    path = os.path.abspath(path)
    _temporaries.add(path)
    try:
        yield path
    finally:
        _temporaries.discard(path)


def registered_temporaries() -> set[str]:
    """The paths inside a `temporary` block now (a copy)."""
    return set(_temporaries)


def remove_temporaries() -> None:
    for path in list(_temporaries):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    _temporaries.clear()
