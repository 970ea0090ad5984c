"""Moments at which a process can be killed: each call it makes that changes the file system.

A SIGKILL can land anywhere, but what a later command finds depends only on which file operations had
happened: so the moments worth trying are the calls that write, create, rename or remove (`os.rename`,
`os.replace`, `os.mkdir`, `os.remove`, `os.fsync`, `shutil.rmtree`, `open` for writing, ...). `counted()`
counts them in this process; `python -m tests.fault_points N ARGV...` runs `linjax ARGV` and SIGKILLs it
just before its N-th one (0: never). Writes inside native libraries (tensorstore's) are not seen, but a
kill at the next call that is comes after them.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import signal
import sys

_OS_CALLS = ("rename", "replace", "mkdir", "remove", "unlink", "rmdir", "fsync", "ftruncate", "pwrite", "symlink")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def install(on_event) -> callable:
    """Calls `on_event()` before every file-system change of this process; returns the function that undoes it."""
    originals = {name: getattr(os, name) for name in _OS_CALLS}
    open_file, os_open, rmtree = builtins.open, os.open, shutil.rmtree

    def before(call):
        def wrapped(*args, **kwargs):
            on_event()
            return call(*args, **kwargs)
        return wrapped

    def opened(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            on_event()
        return open_file(file, mode, *args, **kwargs)

    def os_opened(path, flags, *args, **kwargs):
        if flags & _WRITING:
            on_event()
        return os_open(path, flags, *args, **kwargs)

    for name, call in originals.items():
        setattr(os, name, before(call))
    builtins.open, os.open, shutil.rmtree = opened, os_opened, before(rmtree)

    def undo():
        for name, call in originals.items():
            setattr(os, name, call)
        builtins.open, os.open, shutil.rmtree = open_file, os_open, rmtree

    return undo


@contextlib.contextmanager
def counted():
    """{"events": n}: the file-system changes made inside the block (by any thread of this process)."""
    count = {"events": 0}

    def event():
        count["events"] += 1

    undo = install(event)
    try:
        yield count
    finally:
        undo()


def main(argv: list[str]) -> None:
    at, command = int(argv[0]), argv[1:]
    seen = [0]

    def event():
        seen[0] += 1
        if seen[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)

    install(event)
    from linjax.app.cli import main as linjax

    linjax(command)


if __name__ == "__main__":
    main(sys.argv[1:])
