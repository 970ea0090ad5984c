"""Every mixer's decode state, in one place (docs/architecture.md, "Modes of a mixer").

Each is a NamedTuple (a pytree) that counts the tokens consumed so far in a field
named `length` ([] int32, the position of the next token); the model reads it to
place the positions of the next call, whatever the layer's mechanism.

    KVCache           softmax attention: every key and value so far
    SinksWindowCache  sinks + sliding window (the window-only mixer, and inside LinearState):
                      a WindowCache of the first `sinks` keys/values and the last `window`,
                      and rings of the linear inputs still inside the window
    LinearState       a linear mixer: the kernel's state, short-conv caches, and with a window
                      its SinksWindowCache

WindowCache is defined beside the window kernel whose `prefill` and `step` write it
(kernels/swa.py), SinksWindowCache beside the module that keeps it (sinks_window.py);
both are re-exported here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from linjax.kernels.swa import WindowCache
from linjax.mixers.sinks_window import SinksWindowCache

__all__ = ["KVCache", "LinearState", "SinksWindowCache", "WindowCache"]


class KVCache(NamedTuple):
    """Keys and values of every position so far, head-major so decoding reads them without a transpose."""

    k: jax.Array  # [B, Hkv, max_length, D]
    v: jax.Array  # [B, Hkv, max_length, D]
    length: jax.Array  # [] int32, positions already written


class LinearState(NamedTuple):
    """Decode state of a linear mixer; its size does not depend on the context length."""

    linear: jax.Array  # the kernel's state [B, H, Dk', Dv'] (fp32)
    length: jax.Array  # [] int32, tokens consumed
    conv: tuple | None  # short-conv caches for q, k, v: [B, K-1, channels]
    window: SinksWindowCache | None  # the sinks + window part (None without a window)
