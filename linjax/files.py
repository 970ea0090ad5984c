"""Files in and out: writes that never leave half a file, and documents read from text and JSON files.

Every file linjax writes (results, reports, plots, manifests, metrics) goes through `atomic_file`:
the content is written to a temporary file beside the target, flushed to disk, and renamed over
the target, so a reader, a crash or a full disk sees the old file or the new one, never a part.
An output that one process writes at a time (a run directory, an export, an evaluation's folder)
is guarded by `writer_lock`: a second writer stops with one line naming the first one's pid.
A whole output directory (an export, a conversion, a checkpoint) is written beside its place and
swapped in by `write_directory`; only an earlier output of linjax is ever replaced.

Documents: `.jsonl` (one record per line), `.json` (a record, or a list of records), anything else
(`.txt`, wikitext's `.raw`) one document per file. A record's text is its text field; Alpaca-style
records (`instruction`, `input`, `output`) are joined into one document.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import uuid

from linjax import heartbeat, integrity, storage


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False):
    """An open file (text in UTF-8, or binary) whose content replaces `path` when the block ends
    without an error; on an error `path` is left as it was and the temporary file is removed. A `path`
    that is a symbolic link is written where it leads: the link stays a link."""
    path = os.path.realpath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
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
    being swapped for a new one, and never shows up among the output's own entries. Beside the output
    as links resolve it: a second writer reaching the same run through a symbolic link (or a linked
    parent folder) takes the same lock."""
    parent, name = os.path.split(os.path.realpath(target))
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
    while True:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # the output's folder cannot be made (a file in the way, permissions, space)
            raise _write_error(os.path.abspath(target), err) from None
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


# ----------------------------------------------------------------------------- output directories


def listing(names: list[str], limit: int = 12) -> str:
    """'a, b, c, ... (N more)': the first `limit` names, for an error message."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# Every directory linjax writes with `write_directory` (exports, conversions, linearized checkpoints) holds
# this file, listing its entries: only such a directory, with nothing added since, is ever replaced.
EXPORT_MARKER = ".linjax-export"
# What a training run directory holds beside its checkpoint: such a directory is never replaced.
RUN_ENTRIES = ("checkpoints", "metrics.jsonl")


def _written_entries(directory: str) -> set[str] | None:
    """The entries linjax wrote into `directory` (from its marker), or None if linjax did not write it."""
    try:
        with open(os.path.join(directory, EXPORT_MARKER)) as f:
            return set(json.load(f)["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def refuse_overlap(output: str, inputs, what: str = "the output directory", choose: str = "an --out",
                   relations=("is", "lies inside", "holds")) -> None:
    """Refuses (FileExistsError, one line) an `output` that is, lies inside or holds one of `inputs`
    ({"the training data": path, ...}, or (name, path) pairs; None or a path that does not exist is
    skipped), compared as
    links resolve them: writing there would change, or mix files into, what is read. Call it before
    anything is written. `relations`: which of the three to refuse (an evaluation's results file may lie
    beside a model, but must not be one of its inputs)."""
    out = os.path.realpath(output)
    for name, path in (inputs.items() if isinstance(inputs, dict) else inputs):
        if path is None or not os.path.exists(path):
            continue
        source = os.path.realpath(path)
        if _within(out, source) or _within(source, out):
            relation = "is" if out == source else "lies inside" if _within(out, source) else "holds"
            if relation not in relations:
                continue
            through = "" if (out, source) == (os.path.abspath(output), os.path.abspath(path)) else \
                f" (through links: {out} and {source})"
            raise FileExistsError(f"{what} {os.path.abspath(output)} {relation} {name} {path}{through}; "
                                  f"choose {choose} outside it")


def check_export_directory(directory: str, source: str | None = None) -> str:
    """The path of an output directory that may be (re)written, with links resolved (an output given
    as a link is written where it leads, the link left as it is): absent, empty, or an earlier output
    of linjax with nothing added since. Never the input `source` (nor a directory inside it or holding
    it), a training run, a checkpoint linjax did not write as an output, or anyone's other files."""
    directory = os.path.realpath(directory)
    if source is not None:
        refuse_overlap(directory, {"the input": source})
    if not os.path.exists(directory):
        return directory
    if not os.path.isdir(directory):
        raise FileExistsError(f"{directory} is a file; choose another --out")
    entries = set(os.listdir(directory))
    written = _written_entries(directory)
    if not entries or (written is not None and entries - {EXPORT_MARKER} <= written):
        return directory
    if entries & set(RUN_ENTRIES):
        what = f"a training run ({', '.join(sorted(entries & set(RUN_ENTRIES)))})"
    elif written is None and "linjax.json" in entries:
        what = (f"a linjax checkpoint without {EXPORT_MARKER} (a training run's, or one written before linjax "
                "marked its outputs)")
    elif written is None:
        what = f"files linjax did not write (no {EXPORT_MARKER}): {listing(sorted(entries), 5)}"
    else:
        what = f"files added after linjax wrote it: {listing(sorted(entries - written - {EXPORT_MARKER}), 5)}"
    raise FileExistsError(f"{directory} already exists and holds {what}; linjax replaces only its own earlier "
                          "outputs. Choose another --out, or remove that directory yourself")


def write_directory(directory: str, fill) -> str:
    """Writes a whole output directory: `fill(staging)` fills a new directory beside `directory`, the
    marker is added, then an earlier `directory` is renamed aside, the new one renamed into place, and
    only then the old one removed. A failure (a full disk, an unwritable folder) or a crash before the
    swap leaves the earlier directory as it was; a crash inside the swap leaves the earlier one set
    aside, which the next write (`recover_interrupted_swap`) puts back. One writer at a time
    (`writer_lock`): a second one stops with one line naming the first."""
    directory = os.path.realpath(directory)  # a link to the output: written where it leads
    with writer_lock(directory):
        recover_interrupted_swap(directory)
        directory = check_export_directory(directory)
        parent, name = os.path.split(directory)
        try:
            os.makedirs(parent, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=f".{name}.linjax-new-", dir=parent)
        except OSError as err:
            raise _write_error(directory, err) from err
        try:
            with heartbeat.temporary(staging):
                fill(staging)
                # Written last: the entries linjax may replace, and each file's size and SHA-256 (`integrity`).
                marker = {"written_by": "linjax", "entries": sorted(os.listdir(staging)),
                          "files": integrity.record(staging, exclude=(EXPORT_MARKER,))}
                with open(os.path.join(staging, EXPORT_MARKER), "w") as f:
                    json.dump(marker, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                swap_in(staging, directory)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, WriteFailed):  # a nested output (convert's HF part): report the first cause
                err = err.__cause__
            fault = storage.os_error(err) if isinstance(err, Exception) else None  # tensorstore's ValueError too
            if fault is not None:
                raise _write_error(directory, fault) from err
            raise
    return directory


def verify_output(directory: str) -> None:
    """Checks the files of a directory `write_directory` wrote against the sizes and hashes its marker
    records (`integrity.Damaged`, one line naming the first that differs); a directory written before
    the marker recorded them, or not by linjax, is not checked."""
    path = os.path.join(directory, EXPORT_MARKER)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        raise integrity.Damaged(f"{path} (linjax's record of the files beside it) is damaged; write "
                                f"{directory} again, or remove {EXPORT_MARKER} if you edited it", path) from None
    if files is not None:
        integrity.verify(directory, directory, f"write it again (or restore it from a copy); if you changed it "
                                               f"on purpose, remove its {EXPORT_MARKER} (linjax's record of it)",
                         files=files)


def read_json(path: str):
    """A JSON file linjax wrote; a ValueError naming it if it does not parse (damaged or cut short)."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err}): it is damaged or was cut short; restore it "
                             "from a copy") from None


def recover_interrupted_swap(directory: str) -> None:
    """Undoes what a killed `swap_in` or `write_directory` left beside `directory`: the earlier
    directory set aside (`.NAME.linjax-old-*`) goes back in place if nothing took it, else it is
    removed; staging folders (`.NAME.linjax-new-*`) are removed. Call it holding the writer lock."""
    directory = os.path.abspath(directory)
    parent, name = os.path.split(directory)
    if not os.path.isdir(parent):
        return
    aside = sorted((os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{name}.linjax-old-")),
                   key=os.path.getmtime)
    if aside and not os.path.exists(directory):
        os.rename(aside.pop(), directory)  # the newest: the one the swap had just set aside
    for path in aside + [os.path.join(parent, n) for n in os.listdir(parent)
                         if n.startswith(f".{name}.linjax-new-")]:
        shutil.rmtree(path, ignore_errors=True)


def swap_in(new: str, directory: str) -> None:
    if not os.path.exists(directory):
        os.rename(new, directory)
        return
    parent, name = os.path.split(directory)
    old = tempfile.mkdtemp(prefix=f".{name}.linjax-old-", dir=parent)
    try:
        os.rename(directory, old)  # onto the empty directory just made: POSIX rename replaces it
    except BaseException:
        os.rmdir(old)
        raise
    try:
        os.rename(new, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


class WriteFailed(OSError):
    """An output directory could not be written; the message says what is left and what to do."""


def _write_error(directory: str, err: OSError) -> WriteFailed:
    """One line for people: what failed, that nothing was lost, what to do."""
    reason = err.strerror or str(err)
    if err.filename:
        reason += f" ({err.filename})"
    kept = "its earlier contents are intact" if os.path.isdir(directory) else "nothing was written there"
    return WriteFailed(err.errno, f"could not write {directory}: {reason}; {kept}. Free some space, fix the "
                                  "folder's permissions or choose another --out, then run the command again")
