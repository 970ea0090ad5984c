"""What the Pallas (Triton backend) kernels here share: tile sizes and padding, launch settings,
in-kernel row loads and full-precision matmuls (SWA's kernel), the chunk check of the chunk-state
kernels (chunk_states_pallas.py), and the custom_vjp that differentiates a forward-only kernel
(SWA's) through its `chunked` twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
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


def load_rows(ref, start, n: int):
    """Rows [start, start + n) of a [T, D] (or [T]) ref, as fp32."""
    return ref[pl.ds(start, n)].astype(jnp.float32)


# SWA's in-kernel dots run on fp32 operands at full precision: Triton's lowering otherwise uses
# TF32 (10-bit mantissa) for fp32 dots, which breaks the fp32 tolerances of its tests.
FULL_PRECISION = lax.Precision.HIGHEST


def matmul(a, b):
    return jnp.dot(a, b, precision=FULL_PRECISION, preferred_element_type=jnp.float32)


def matmul_t(a, b):
    """a @ bᵀ."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=FULL_PRECISION,
                           preferred_element_type=jnp.float32)


# ------------------------------------------------------------ differentiation


def with_chunked_backward(kernel_forward, chunked_forward, *arrays):
    """`kernel_forward(*arrays)` with a `jax.custom_vjp` whose backward is the
    VJP of `chunked_forward(*arrays)` (same arguments, same results; entries
    of `arrays` may be None, e.g. no initial state).

    For the forward-only Pallas kernels (SWA; GLA and GDN have their own
    backward kernels): the backward recomputes the forward through the pure-JAX chunked
    implementation and differentiates that. This is exact (both compute the
    same function) but not fast. Static options must already be bound (a lambda or
    functools.partial).
    """

    @jax.custom_vjp
    def run(*arrays):
        return kernel_forward(*arrays)

    def run_fwd(*arrays):
        return run(*arrays), arrays

    def chunked_vjp(arrays, cotangents):
        out, vjp = jax.vjp(chunked_forward, *arrays)
        # Cotangents arrive in the kernel's output dtypes; give the VJP its own.
        return vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangents, out))

    # jit: called eagerly, the backward is one compiled program instead of
    # op-by-op dispatch; under an outer jit it is simply inlined.
    run.defvjp(run_fwd, jax.jit(chunked_vjp))
    return run(*arrays)


def default_interpret(interpret):
    """None → interpret on CPU (where no Triton GPU exists), compile otherwise."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)
