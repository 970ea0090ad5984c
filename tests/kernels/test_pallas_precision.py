"""The precision of every dot product inside the Pallas kernels, read from the traced kernels.

Triton lowers a dot at the default precision on fp32 operands to TF32 (10-bit mantissas), which
is what a GPU would silently run where a kernel meant fp32. So, for each kernel's forward and
backward as a GPU traces them (interpret=False), in fp32 and bf16:
- every dot accumulates in fp32 (fp32 result type);
- every dot whose operands are fp32 asks for fp32's accuracy: IEEE fp32 (Precision.HIGHEST) or
  three TF32 products (DotAlgorithmPreset.TF32_TF32_F32_X3), never one TF32 pass.
bf16 operands (bf16 inputs fed to the tensor cores) are allowed by these checks.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

from linjax.kernels import swa
from linjax.linearize import LINEAR_MIXERS
from tests.helpers import linear_mechanisms

B, T, H, HKV, D = 1, 100, 4, 2, 64


def kernel_dots(jaxpr) -> list:
    """(operand dtypes, precision, result dtype) of every dot_general inside a pallas_call's body."""
    found = []

    def walk(jaxpr, inside_kernel):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and inside_kernel:
                found.append((tuple(str(v.aval.dtype) for v in eqn.invars), eqn.params.get("precision"),
                              str(eqn.outvars[0].aval.dtype)))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        sub = sub.jaxpr
                    if isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, inside_kernel or eqn.primitive.name == "pallas_call")

    walk(jaxpr.jaxpr, False)
    return found


def inputs(dtype, mech):
    """(kernel module, inputs): each linear mechanism of the registry on its example inputs, and sinks + window."""
    if mech == "swa":
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (B, T, H, D)).astype(dtype)
        k, v = (jax.random.normal(key, (B, T, HKV, D)).astype(dtype) for key in keys[1:])
        return swa, (q, k, v)
    mixer = LINEAR_MIXERS[mech]
    return mixer.kernel_module, mixer.example_inputs(jax.random.key(0), B, T, H, HKV, D, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mech", [*linear_mechanisms(), "swa"])
def test_kernel_dots_accumulate_in_fp32_at_full_precision(mech, dtype):
    module, args = inputs(jnp.dtype(dtype), mech)
    settings = dict(sinks=8, window=56) if mech == "swa" else {}
    kernel = lambda *a: module.pallas(*a, interpret=False, **settings)  # noqa: E731
    loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(kernel(*a)))  # noqa: E731
    dots = kernel_dots(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args))
    assert dots, f"no dot product found in the {mech} kernels"
    assert [d for d in dots if d[2] != "float32"] == [], "dots that do not accumulate in fp32"
    full = (jax.lax.Precision.HIGHEST, (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST),
            jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    below_full = [d for d in dots if "float32" in d[0] and d[1] not in full]
    assert below_full == [], "fp32 dots at a precision Triton runs as TF32"
