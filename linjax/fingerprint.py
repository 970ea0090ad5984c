"""What a run was made from: content hashes of its base model, its tokenizer and its training data.

A training run records them when it starts (config.json's `inputs`) and when it finishes
(linjax.json's `inputs`). `linjax train --resume`, `linjax run` and `linjax.load(run)` compare
them with the files as they are now and refuse a difference with one line naming it, since the
same names can hold other contents (a base model converted again, an edited data file, a
relative path read from another directory): the run would continue, or load, as another model
with nothing said. `--allow-changed-inputs` (or `LINJAX_ALLOW_CHANGED_INPUTS=1`, or the
`changes_allowed()` block) lets a user who means it go on. A run recorded before linjax kept
fingerprints has none, and nothing is checked.

    base model   weights: the GGUF file, or an HF directory's config.json and safetensors, or a
                 linjax checkpoint's manifest and parameters; a hub id also records its revision
    tokenizer    the tokenizer files beside the weights (a GGUF file's are inside it)
    data         every training file in reading order: absolute path, size, SHA-256

Each file is hashed once per process (cached by its path, size and modification time); a file
of the Hugging Face hub cache is named by its SHA-256 already, which is used as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from linjax import environment

ALLOW_ENV = "LINJAX_ALLOW_CHANGED_INPUTS"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")

_digests: dict[tuple, str] = {}
_allowed = False


@contextlib.contextmanager
def changes_allowed(allowed: bool = True):
    """Inside the block, changed inputs are reported by `check` as a note instead of refused."""
    global _allowed
    before, _allowed = _allowed, _allowed or allowed
    try:
        yield
    finally:
        _allowed = before


def allowed() -> bool:
    return _allowed or environment.flag(ALLOW_ENV)


def file_sha256(path: str) -> str:
    real = os.path.realpath(path)
    parent, name = os.path.split(real)
    if os.path.basename(parent) == "blobs" and len(name) == 64:  # the hub cache: named by content
        return name
    stat = os.stat(real)
    key = (real, stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(real, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def files_sha256(directory: str, names) -> str | None:
    """One SHA-256 over the named files of `directory` that exist (names and contents, in name order);
    None if none does."""
    digest, found = hashlib.sha256(), False
    for name in sorted(names):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            found = True
            digest.update(f"{name}\0{file_sha256(path)}\0".encode())
    return digest.hexdigest() if found else None


def _tree(directory: str, *folders: str) -> list[str]:
    """The files under `directory`'s `folders`, relative to `directory`."""
    found = []
    for folder in folders:
        for root, _, names in os.walk(os.path.join(directory, folder)):
            found += [os.path.relpath(os.path.join(root, n), directory) for n in names]
    return found


def model_fingerprint(source: str) -> dict:
    """{"weights": sha256, "tokenizer": sha256 or None[, "revision": hub commit]} of a model source
    (whatever `linjax.load` accepts)."""
    from linjax.convert import checkpoint, sources

    source = os.fspath(source)
    if source in sources._EMBEDDED:
        source = sources.embedded_gguf_path(source)
    revision = None
    if source.endswith(".gguf") and os.path.isfile(source):
        digest = file_sha256(source)
        return {"weights": digest, "tokenizer": digest}  # the GGUF file holds its tokenizer
    if not os.path.isdir(source) and sources._looks_like_hub_id(source):
        from huggingface_hub import snapshot_download

        directory = snapshot_download(source, allow_patterns=sources.HUB_PATTERNS)
        source, revision = directory, os.path.basename(directory)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"model source {source!r} not found")
    if checkpoint.is_checkpoint(source):
        names = [checkpoint.MANIFEST] + _tree(source, "params", "trainable")
        tokenizer = files_sha256(source, _tree(source, "tokenizer"))
    else:
        names = [n for n in os.listdir(source)
                 if n == "config.json" or n.endswith((".safetensors", ".safetensors.index.json"))]
        tokenizer = files_sha256(source, TOKENIZER_FILES)
    fingerprint = {"weights": files_sha256(source, names), "tokenizer": tokenizer}
    return {**fingerprint, "revision": revision} if revision else fingerprint


def data_manifest(data) -> dict:
    """The training data of a [data] section: each local file, or a streamed dataset's name."""
    if data.dataset:  # streamed from the hub: no files to hash
        return {"dataset": data.dataset, "config": data.dataset_config, "split": data.split}
    from linjax.train.data import training_files

    return {"files": [{"path": os.path.abspath(p), "size": os.path.getsize(p), "sha256": file_sha256(p)}
                      for p in training_files(data.paths)]}


def run_inputs(config) -> dict:
    """config.json's `inputs` for an ExperimentConfig."""
    return {"model": model_fingerprint(config.model.source), "data": data_manifest(config.data)}


def _short(digest) -> str:
    return str(digest)[:12] if digest else "none"


def describe_changes(recorded: dict, current: dict) -> list[str]:
    """What differs between two fingerprints (of `run_inputs`' form, or a model's alone under "model"),
    one phrase each; only what both record is compared."""
    changes = []
    old, new = recorded.get("model") or {}, current.get("model") or {}
    for key, what in (("weights", "the base model's weights"), ("tokenizer", "the tokenizer files"),
                      ("revision", "the hub revision")):
        if key in old and key in new and old[key] != new[key]:
            changes.append(f"{what} ({_short(old[key])} → {_short(new[key])})")
    old, new = recorded.get("data"), current.get("data")
    if old and new and old != new:
        if "files" in old and "files" in new:
            if [f["sha256"] for f in old["files"]] != [f["sha256"] for f in new["files"]]:
                before = {f["path"]: f["sha256"] for f in old["files"]}
                after = {f["path"]: f["sha256"] for f in new["files"]}
                differing = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
                shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
                changes.append(f"the training data ({len(old['files'])} → {len(new['files'])} files; "
                               f"differing: {shown or 'the order'})")
        elif old != new:
            changes.append(f"the training data ({old} → {new})")
    return changes


def check(recorded: dict | None, current: dict, where: str, action: str) -> list[str]:
    """Refuses (ValueError, one line) a change between the `recorded` fingerprint of `where` and the
    `current` one, unless changes are allowed; returns the changes (to record them)."""
    if not recorded:
        return []  # recorded before linjax kept fingerprints
    changes = describe_changes(recorded, current)
    if changes and not allowed():
        raise ValueError(f"{where}: inputs changed since the run recorded them: {'; '.join(changes)}. "
                         f"{action} would give another model under the same name; restore them, or pass "
                         f"--allow-changed-inputs ({ALLOW_ENV}=1) if you mean it")
    return changes
