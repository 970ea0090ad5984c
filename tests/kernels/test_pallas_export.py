"""Lower every Pallas kernel for CUDA with `jax.export` on this CPU machine.

The Triton backend builds the kernel's Triton IR while lowering, so a kernel
that uses an op Triton cannot express (a 3-D dot, a non-power-of-two tile, a
dynamic slice of a value) fails here instead of on a GPU. The Triton custom
call has no stable export guarantee, hence its disabled safety check.
Shapes: T not a multiple of the chunk, GQA (H = 4, Hkv = 2) and Dv = 128 (two
Dv blocks per head); bf16 and fp32. The GLA and GDN backward kernels are
exported through `jax.grad` of `pallas`.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax import export

from linjax.kernels import gdn, gla, kgla, linear_attn, swa

TRITON_CALL = "__gpu$xla.gpu.triton"
B, T, H, HKV = 1, 200, 4, 2


def exported_text(fn, *args):
    exported = export.export(
        jax.jit(fn), platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


def shapes(dtype, D, *, beta=False, scalar_gate=False):
    s = jax.ShapeDtypeStruct
    args = [s((B, T, H, D), dtype), s((B, T, HKV, D), dtype), s((B, T, HKV, D), dtype),
            s((B, T, H) if scalar_gate else (B, T, H, D), jnp.float32)]
    if beta:
        args.append(s((B, T, H), jnp.float32))
    return args


CASES = {
    "gla": (lambda *a: gla.pallas(*a, interpret=False), {}, "linjax_gla_chunked_fwd"),
    "kgla": (lambda *a: kgla.pallas(*a, interpret=False), {"beta": True}, "linjax_gla_chunked_fwd"),
    "gdn": (lambda *a: gdn.pallas(*a, interpret=False), {"beta": True}, "linjax_gdn_chunked_fwd"),
    "gdn_scalar_gate": (lambda *a: gdn.pallas(*a, interpret=False),
                        {"beta": True, "scalar_gate": True}, "linjax_gdn_chunked_fwd"),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mech", list(CASES))
def test_linear_kernels_lower_to_triton(mech, dtype):
    fn, extra, kernel_name = CASES[mech]
    text = exported_text(fn, *shapes(jnp.dtype(dtype), 128, **extra))
    assert text.count(TRITON_CALL) == 1 and kernel_name in text


def test_linear_attn_lowers_to_triton():
    q, k, v = shapes(jnp.bfloat16, 64)[:3]
    text = exported_text(lambda *a: linear_attn.pallas(*a, interpret=False), q, k, v)
    assert text.count(TRITON_CALL) == 1 and "linjax_gla_chunked_fwd" in text


@pytest.mark.parametrize("sinks, window", [(8, 56), (0, 64), (70, 5)])
def test_swa_lowers_to_triton(sinks, window):
    q, k, v = shapes(jnp.bfloat16, 128)[:3]
    fn = lambda *a: swa.pallas(*a, sinks=sinks, window=window, interpret=False)
    text = exported_text(fn, q, k, v)
    assert text.count(TRITON_CALL) == 1 and "linjax_swa_sinks_fwd" in text


@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gdn_backward_lowers_to_triton(dtype, scalar_gate):
    """jax.grad of gdn.pallas exports for CUDA with its two backward kernels as Triton calls;
    value_and_grad adds the forward kernel."""
    def loss(*args):
        o, state = gdn.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    args = shapes(jnp.dtype(dtype), 128, beta=True, scalar_gate=scalar_gate)
    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 2
    assert "linjax_gdn_chunked_states" in text and "linjax_gdn_chunked_bwd" in text
    text = exported_text(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 3 and "linjax_gdn_chunked_fwd" in text


def gla_loss(*args):
    o, state = gla.pallas(*args[:4], initial_state=args[4], interpret=False)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)


def gla_grad_shapes(dtype, D):
    return [*shapes(dtype, D), jax.ShapeDtypeStruct((B, H, D, D), jnp.float32)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gla_backward_lowers_to_triton(dtype):
    """jax.grad of gla.pallas (q, k, v, log α, initial state) exports for CUDA with the two
    backward kernels, the state recompute and the reverse chunk loop, as Triton calls (the
    forward kernel is dead code under plain grad; value_and_grad keeps it)."""
    args = gla_grad_shapes(jnp.dtype(dtype), 128)
    text = exported_text(jax.grad(gla_loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 2
    assert "linjax_gla_chunked_states" in text and "linjax_gla_chunked_bwd" in text
    text = exported_text(jax.value_and_grad(gla_loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 3 and "linjax_gla_chunked_fwd" in text


def test_kgla_backward_lowers_to_triton():
    def loss(*args):
        o, state = kgla.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *shapes(jnp.bfloat16, 64, beta=True))
    assert text.count(TRITON_CALL) == 2 and "linjax_gla_chunked_bwd" in text


def kernel_dots(fn, *args):
    """The dot_general equations inside every pallas_call of fn's jaxpr (the kernel bodies)."""
    dots = []

    def walk(jaxpr, inside_kernel):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and inside_kernel:
                dots.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, inside_kernel or eqn.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return dots


@pytest.mark.parametrize("mech", [*CASES, "swa", "gla_backward", "gdn_backward"])
def test_kernel_dots_run_at_full_fp32_precision(mech):
    """Triton lowers an fp32 dot at the default precision to TF32; every dot inside a kernel
    asks for HIGHEST (IEEE fp32), which the fp32 tolerances and the gate sums need on a GPU."""
    if mech == "gla_backward":
        fn, args = jax.grad(gla_loss, argnums=(0, 1, 2, 3, 4)), gla_grad_shapes(jnp.float32, 64)
    elif mech == "gdn_backward":
        loss = lambda *a: jnp.sum(gdn.pallas(*a, interpret=False)[0])
        fn, args = jax.grad(loss, argnums=(0, 1, 2, 3, 4)), shapes(jnp.float32, 64, beta=True)
    elif mech == "swa":
        fn, args = (lambda *a: swa.pallas(*a, sinks=8, window=56, interpret=False)), shapes(jnp.float32, 64)[:3]
    else:
        fn, extra, _ = CASES[mech]
        args = shapes(jnp.float32, 64, **extra)
    dots = kernel_dots(fn, *args)
    assert dots, "no dot found inside the kernel: the jaxpr walk is broken"
    precisions = {str(eqn.params["precision"]) for eqn in dots}
    assert precisions == {str((jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))}, precisions
