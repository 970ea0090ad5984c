"""Content hashes of what linjax writes, recorded last and checked before it is read again.

Neither orbax nor tensorstore checksums what it stores, and safetensors checks only its header:
flipped bytes in a checkpoint load as other numbers (NaN among them) and nothing says so. So every
directory linjax writes carries the size and SHA-256 of each of its files, written after all of
them (the record is the last file, so its presence also says the directory is complete):

    checkpoints/<step>/linjax-sha256.json   a training checkpoint (orbax), after orbax commits it
    trainable/linjax-sha256.json            a finished run's parameters, before they are swapped in
    .linjax-export ("files")                an export, conversion, linearized checkpoint or GGUF
                                            cache (`files.write_directory`), before the swap

`verify` compares the files with the record and raises `Damaged`, one line naming the first file
that differs (missing, truncated, or other bytes) and what to do. Resume, `linjax.load` and so every
evaluation call it before reading parameters; a directory written before linjax kept records has
none and is read as before.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "linjax-sha256.json"


class Damaged(ValueError):
    """A file differs from the record written with it; `path` names the file."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def record(directory: str, exclude=()) -> dict:
    """{relative path: {"bytes": size, "sha256": digest}} of every file under `directory`, in name order,
    but the names in `exclude` (at its top level)."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative not in exclude:
                files[relative] = {"bytes": os.path.getsize(path), "sha256": sha256(path)}
    return files


def write_manifest(directory: str) -> str:
    """Records every file of `directory` in its `MANIFEST`; call it once everything else is written."""
    from linjax.files import write_json

    return write_json(os.path.join(directory, MANIFEST), {"written_by": "linjax",
                                                          "files": record(directory, exclude=(MANIFEST,))})


def has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict:
    """The record of `directory`'s `MANIFEST`; `Damaged` if the record itself cannot be read."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as err:
        raise Damaged(f"{path} (the record of the files beside it) is damaged: {err or 'not a record'}",
                      path) from None
    return files


def first_difference(directory: str, files: dict) -> tuple[str, str] | None:
    """(path, what is wrong) for the first file of `directory` that differs from `files` (`record`'s
    form), or None when all are as recorded."""
    for relative, expected in sorted(files.items()):
        path = os.path.join(directory, relative)
        try:
            size = os.path.getsize(path)
        except OSError:
            return path, "is missing"
        if not isinstance(expected, dict) or size != expected.get("bytes"):
            wanted = expected.get("bytes") if isinstance(expected, dict) else "?"
            return path, f"has {size} bytes where {wanted} were written (truncated or damaged)"
        if sha256(path) != expected.get("sha256"):
            return path, "does not hold the bytes that were written (its SHA-256 differs): it is damaged"
    return None


def verify(directory: str, what: str, advice: str, files: dict | None = None) -> None:
    """Raises `Damaged` (one line: the file, what is wrong, `advice`) if a file of `directory` differs
    from its record: `files`, else the directory's `MANIFEST`. `what` names the directory for people."""
    if files is None:
        files = read_manifest(directory)
    difference = first_difference(directory, files)
    if difference is not None:
        path, wrong = difference
        raise Damaged(f"{what}: {path} {wrong}" + (f"; {advice}" if advice else ""), path)


def refuse_non_finite(state, where: str, advice: str) -> None:
    """Raises `Damaged` naming the first parameter of `state` (a pytree of arrays, or an nnx State)
    holding NaN or infinity: no model linjax writes has one, so it was read from a damaged file."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if isinstance(state, nnx.State):
        state = nnx.to_pure_dict(state)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not jnp.issubdtype(getattr(leaf, "dtype", None) or jnp.int32, jnp.inexact):
            continue
        bad = int(leaf.size - jnp.isfinite(leaf).sum())
        if bad:
            name = ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)
            raise Damaged(f"{where}: parameter {name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or "
                          f"infinity), which no saved model has; {advice}", where)
