"""Files in and out: writes that never leave half a file, and documents read from text and JSON files.

Every file linjax writes (results, reports, plots, manifests, metrics) goes through `atomic_file`:
the content is written to a temporary file beside the target, flushed to disk, and renamed over
the target, so a reader, a crash or a full disk sees the old file or the new one, never a part.
An output that one process writes at a time (a run directory, an export, an evaluation's folder)
is guarded by `writer_lock`: a second writer stops with one line naming the first one's pid.

Documents: `.jsonl` (one record per line), `.json` (a record, or a list of records), anything else
(`.txt`, wikitext's `.raw`) one document per file. A record's text is its text field; Alpaca-style
records (`instruction`, `input`, `output`) are joined into one document.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False):
    """An open file (text in UTF-8, or binary) whose content replaces `path` when the block ends
    without an error; on an error `path` is left as it was and the temporary file is removed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Beside the target (os.replace cannot cross file systems) and named after it; a unique part, so
    # that two writers of the same file never write into one temporary file.
    temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "xb" if binary else "x", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename, so a power cut cannot leave an empty file
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def write_text(path: str, text: str) -> str:
    with atomic_file(path) as f:
        f.write(text)
    return path


def write_json(path: str, data) -> str:
    with atomic_file(path) as f:
        json.dump(data, f, indent=2)
    return path


def pyplot():
    """matplotlib.pyplot drawing into files only (the Agg backend, no window). Imported on first use:
    matplotlib takes about half a second to import, which commands that draw nothing should not pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figure(fig, path: str, dpi: int = 120) -> str:
    """Lays out, saves (the format from the file name, e.g. .png) and closes a matplotlib figure."""
    fig.tight_layout()
    with atomic_file(path, binary=True) as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:] or None, dpi=dpi)
    pyplot().close(fig)
    return path


def record_text(record, text_field: str, where: str) -> str:
    """The document in one record of a JSON or JSON Lines file; `where` names it in errors."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if text_field in record:
            return str(record[text_field])
        if "instruction" in record and "output" in record:
            parts = [record["instruction"], record.get("input", ""), record["output"]]
            return "\n\n".join(p for p in parts if p)
    raise ValueError(f"{where}: record has no {text_field!r} field (keys: "
                     f"{sorted(record) if isinstance(record, dict) else type(record).__name__})")


def read_file_documents(path: str, text_field: str = "text") -> list[str]:
    """The documents of one file, in order, empty ones included."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [record_text(json.loads(line), text_field, f"{path}:{n}")
                    for n, line in enumerate(f, 1) if line.strip()]
        if path.endswith(".json"):
            data = json.load(f)
            return [record_text(r, text_field, path) for r in (data if isinstance(data, list) else [data])]
        return [f.read()]


class WriterBusy(BlockingIOError):
    """Another process is writing the same output; the message names it and its pid."""


_held: dict[str, int] = {}  # lock files this process holds → how many nested `writer_lock`s hold each


def lock_path(target: str) -> str:
    """The lock file of an output (a directory or a file): beside it, so that it survives the output
    being swapped for a new one, and never shows up among the output's own entries."""
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}.linjax-lock")


@contextlib.contextmanager
def writer_lock(target: str, what: str = "", wait: bool = False):
    """One writer at a time for `target`: an exclusive `fcntl.flock` on `lock_path(target)`, held
    until the block ends (or the process dies: the kernel releases it, so a killed writer never
    leaves a stale lock). Another process holding it: `WriterBusy` naming its pid, or with `wait`,
    block until it is done. Re-entrant within a process (a `linjax run` stage that trains holds
    the run directory's lock once). The lock file is removed on release."""
    import fcntl

    path = lock_path(target)
    if path in _held:
        _held[path] += 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise WriterBusy(errno.EAGAIN, f"{what or os.path.abspath(target)} is being written by another "
                                           f"process (pid {holder or 'unknown'}, lock {path}); wait for it to "
                                           "finish or stop it, then run the command again") from None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us may have removed the file after we opened it: then we locked a file that
        # no longer has the name, and must lock the one that does.
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[path] = 1
        yield
    finally:
        _held.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # while still locked, so no one locks the removed file and keeps it
        os.close(fd)
