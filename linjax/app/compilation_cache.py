"""JAX's persistent compilation cache for the `linjax` command, on unless the user chose otherwise.

Every `linjax` call is a new process, and JAX compiles a program again in each: the same training
step, the prefill pieces of `generate`, each evaluation's forward pass. A RULER grid or a sweep of
evaluations runs many such calls with identical programs, and on a GPU the Pallas kernels' first
compilation takes minutes. With the cache, the second call reads the compiled program from disk.

The folder is `$LINJAX_CACHE/xla` (the converted models' cache, default `~/.cache/linjax`), at most
4 GiB (JAX evicts the least recently used programs beyond it). A JAX_COMPILATION_CACHE_DIR the user
set is left as it is; LINJAX_COMPILATION_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import os

import jax

from linjax import environment
from linjax.convert.sources import cache_dir

MAX_BYTES = 4 << 30


def folder(environ=None) -> str | None:
    """Where the `linjax` command keeps compiled programs, or None when the user chose otherwise."""
    environ = os.environ if environ is None else environ
    if not environment.flag("LINJAX_COMPILATION_CACHE", True, environ) or environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    return os.path.join(cache_dir(), "xla")


def enable() -> str | None:
    """Points JAX at `folder()` before anything compiles; returns the folder, or None if left off."""
    path = folder()
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
