"""File systems that fail the way real ones do, for tests: a full tmpfs and a read-only tree, made in a user and
mount namespace (`unshare --user --map-root-user --mount`), which needs no root and leaves the machine's own
mounts alone; and damage done to files (flipped bytes, a truncation), as a disk or a copy gone wrong leaves it.

As root, a folder's permissions stop no write (the suite runs as root in CI), and a disk cannot be filled on
purpose; a mount in a namespace of its own is both real and private to the commands run in it.
"""

from __future__ import annotations

import functools
import random
import shlex
import subprocess
import sys
import tempfile

from tests.helpers import missing, python_environment


@functools.cache
def namespaces_work() -> bool:
    """Whether this machine lets an unprivileged process make a user and mount namespace and mount in it."""
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || mount -t tmpfs -o size=64k "
                               "tmpfs /tmp"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def require_namespaces() -> None:
    if not namespaces_work():
        missing("user and mount namespaces are not allowed here (`unshare --user --map-root-user --mount`), so no "
                "tmpfs or read-only mount can be made without root")


def tmpfs(path, size: str) -> str:
    """Shell: a tmpfs of `size` (e.g. "1m") mounted over `path`."""
    return f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(path))}"


def read_only(path) -> str:
    """Shell: `path` mounted again over itself, read-only."""
    quoted = shlex.quote(str(path))
    return f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted} {quoted}"


def linjax(*argv) -> str:
    """Shell: the `linjax` command of this interpreter's installed linjax, with `argv`."""
    words = [sys.executable, "-c", "import sys; from linjax.app.cli import main; main(sys.argv[1:])", *map(str, argv)]
    return " ".join(shlex.quote(w) for w in words)


def in_namespace(script: str, *, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs the shell `script` in a new user and mount namespace (its mounts vanish with it), with the
    installed linjax importable (`helpers.python_environment`); fails the test if namespaces are not allowed."""
    require_namespaces()
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "set -e\n" + script],
                          cwd=cwd or tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout,
                          env=python_environment())


def flip_bytes(path, count: int = 64, seed: int = 0) -> None:
    """Inverts `count` bytes of the file at positions drawn from `seed` (a bad sector, a bad copy)."""
    data = bytearray(open(path, "rb").read())
    rng = random.Random(seed)
    for position in rng.sample(range(len(data)), min(count, len(data))):
        data[position] ^= 0xFF
    open(path, "wb").write(bytes(data))


def truncate(path, keep: float = 0.5) -> None:
    """Cuts the file to `keep` of its length (a copy or a download cut short)."""
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep)])
