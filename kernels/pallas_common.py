"""What the Pallas (Triton backend) kernels here share: tile sizes and padding, launch settings,
the chunk check of the chunk-state kernels (chunk_states_pallas.py), and whether to interpret."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_BLOCK_V = 64  # Dv columns per program


# ---------------------------------------------------------------- wrapper side

PALLAS_MIN_CHUNK = 16  # a Triton dot needs sides ≥ 16


def check_pallas_chunk(chunk: int):
    """The chunk of the chunk-state Pallas kernels: a power of two ≥ 16 (the decay tree halves it,
    Triton dots need 16 rows)."""
    if chunk < PALLAS_MIN_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two ≥ {PALLAS_MIN_CHUNK}; got {chunk}")


def tile_size(n: int) -> int:
    """Smallest power of two ≥ max(n, 16): Triton tiles are powers of two and
    its matmuls need sides ≥ 16."""
    return max(16, pl.next_power_of_2(n))


def pad_axis(x, axis: int, size: int, value=0.0):
    """Pad `x` with `value` at the end of `axis` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def triton_params():
    """Triton launch settings (selecting them is what picks the Triton backend
    over Mosaic GPU). Untuned: no GPU was at hand; 8 warps may suit Dk = 128."""
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


# ------------------------------------------------------------ in-kernel pieces


def default_interpret(interpret):
    """None → interpret on CPU (where no Triton GPU exists), compile otherwise."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)
