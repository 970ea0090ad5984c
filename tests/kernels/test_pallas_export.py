"""Lower every Pallas kernel for CUDA with `jax.export` on this CPU machine.

The Triton backend builds the kernel's Triton IR while lowering, so a kernel
that uses an op Triton cannot express (a 3-D dot, a non-power-of-two tile, a
dynamic slice of a value) fails here instead of on a GPU. The Triton custom
call has no stable export guarantee, hence its disabled safety check.
Shapes: T not a multiple of the chunk, GQA (H = 4, Hkv = 2) and Dv = 128 (two
Dv blocks per head); bf16 and fp32. GLA, kGLA, linear attention and GDN run the
chunk-state pass (chunk_states_pallas.py) as their Pallas kernel, forward and,
through `jax.grad` of `pallas`, its reverse; GDN also its in-chunk kernel
(chunk_intra_pallas.py), whose gradient is batched XLA.
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


def shapes(dtype, D, *, beta=False, scalar_gate=False, T=T):
    s = jax.ShapeDtypeStruct
    args = [s((B, T, H, D), dtype), s((B, T, HKV, D), dtype), s((B, T, HKV, D), dtype),
            s((B, T, H) if scalar_gate else (B, T, H, D), jnp.float32)]
    if beta:
        args.append(s((B, T, H), jnp.float32))
    return args


STATES_FWD, STATES_BWD = "linjax_chunk_states_fwd", "linjax_chunk_states_bwd"
GDN_IN_CHUNK = "linjax_gdn_in_chunk_fwd"
CASES = {
    "gla": (lambda *a: gla.pallas(*a, interpret=False), {}, (STATES_FWD,)),
    "kgla": (lambda *a: kgla.pallas(*a, interpret=False), {"beta": True}, (STATES_FWD,)),
    "gdn": (lambda *a: gdn.pallas(*a, interpret=False), {"beta": True}, (GDN_IN_CHUNK, STATES_FWD)),
    "gdn_scalar_gate": (lambda *a: gdn.pallas(*a, interpret=False),
                        {"beta": True, "scalar_gate": True}, (GDN_IN_CHUNK, STATES_FWD)),
    "gdn_xla_in_chunk": (lambda *a: gdn.pallas(*a, interpret=False, intra="xla"), {"beta": True}, (STATES_FWD,)),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mech", list(CASES))
def test_linear_kernels_lower_to_triton(mech, dtype):
    fn, extra, kernel_names = CASES[mech]
    text = exported_text(fn, *shapes(jnp.dtype(dtype), 128, **extra))
    assert text.count(TRITON_CALL) == len(kernel_names) and all(name in text for name in kernel_names)


def test_linear_attn_lowers_to_triton():
    q, k, v = shapes(jnp.bfloat16, 64)[:3]
    text = exported_text(lambda *a: linear_attn.pallas(*a, interpret=False), q, k, v)
    assert text.count(TRITON_CALL) == 1 and STATES_FWD in text


@pytest.mark.parametrize("sinks, window", [(8, 56), (0, 64), (70, 5)])
def test_swa_lowers_to_triton(sinks, window):
    q, k, v = shapes(jnp.bfloat16, 128)[:3]
    fn = lambda *a: swa.pallas(*a, sinks=sinks, window=window, interpret=False)
    text = exported_text(fn, q, k, v)
    assert text.count(TRITON_CALL) == 1 and "linjax_swa_sinks_fwd" in text


@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gdn_backward_lowers_to_triton(dtype, scalar_gate):
    """jax.grad of gdn.pallas exports for CUDA with the in-chunk kernel, the state pass and its
    reverse as Triton calls (the forward pass is needed by the gradient: its states feed the outputs;
    the in-chunk work's gradient is batched XLA)."""
    def loss(*args):
        o, state = gdn.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    args = shapes(jnp.dtype(dtype), 128, beta=True, scalar_gate=scalar_gate)
    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 3 and all(name in text for name in (GDN_IN_CHUNK, STATES_FWD, STATES_BWD))


def gla_loss(*args):
    o, state = gla.pallas(*args[:4], initial_state=args[4], interpret=False)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)


def gla_grad_shapes(dtype, D):
    return [*shapes(dtype, D), jax.ShapeDtypeStruct((B, H, D, D), jnp.float32)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gla_backward_lowers_to_triton(dtype):
    args = gla_grad_shapes(jnp.dtype(dtype), 128)
    text = exported_text(jax.grad(gla_loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert text.count(TRITON_CALL) == 2 and STATES_FWD in text and STATES_BWD in text


def test_kgla_backward_lowers_to_triton():
    def loss(*args):
        o, state = kgla.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *shapes(jnp.bfloat16, 64, beta=True))
    assert text.count(TRITON_CALL) == 2 and STATES_BWD in text


def kernel_dots(fn, *args, kernel=""):
    """The dot_general equations inside every pallas_call of fn's jaxpr (the kernel bodies) whose
    name contains `kernel`."""
    dots = []

    def walk(jaxpr, inside_kernel):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and inside_kernel:
                dots.append(eqn)
            entering = eqn.primitive.name == "pallas_call" and kernel in str(
                eqn.params.get("name", eqn.params.get("name_and_src_info")))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, inside_kernel or entering)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return dots


def linear_kernel_program(mech, dtype, T=T):
    """(fn, args) whose jaxpr holds the kernel(s) of `mech`: a forward case, or a gradient."""
    if mech == "gla_backward":
        return jax.grad(gla_loss, argnums=(0, 1, 2, 3, 4)), [*shapes(dtype, 64, T=T),
                                                             jax.ShapeDtypeStruct((B, H, 64, 64), jnp.float32)]
    if mech == "gdn_backward":
        loss = lambda *a: jnp.sum(gdn.pallas(*a, interpret=False)[0].astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), shapes(dtype, 64, beta=True, T=T)
    fn, extra, _ = CASES[mech]
    return fn, shapes(dtype, 64, T=T, **extra)


LINEAR_KERNELS = [*CASES, "gla_backward", "gdn_backward"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mech", LINEAR_KERNELS)
def test_state_pass_dots_take_the_model_dtype_and_accumulate_in_fp32(mech, dtype):
    """Every dot inside the chunk-state kernels takes operands in the inputs' dtype (bf16: tensor
    cores) and accumulates in fp32; bf16 dots at the default precision, fp32 ones at HIGHEST (IEEE
    fp32, not TF32). (GDN's in-chunk kernel also has fp32 dots in bf16 models: its triangular solve.)"""
    fn, args = linear_kernel_program(mech, jnp.dtype(dtype))
    dots = kernel_dots(fn, *args, kernel="linjax_chunk_states")
    assert dots, "no dot found inside the kernel: the jaxpr walk is broken"
    for eqn in dots:
        assert {str(x.aval.dtype) for x in eqn.invars} == {dtype}
        assert eqn.params["preferred_element_type"] == jnp.float32
        highest = jax.lax.Precision.HIGHEST in (eqn.params["precision"] or ())
        assert highest == (dtype == "float32")


def kernel_sizes(fn, *args):
    """Equation counts of the kernel bodies (each pallas_call's jaxpr, nested jaxprs included)."""
    def count(jaxpr):
        return sum(1 + sum(count(sub) for sub in jax.extend.core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)

    sizes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                sizes.append(count(eqn.params["jaxpr"]))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sizes


@pytest.mark.parametrize("mech", ["gdn_backward", "gla_backward"])
def test_kernel_programs_do_not_grow_with_the_sequence(mech):
    """The chunks are a loop inside each kernel, not unrolled: the same kernel bodies at T 200
    and T 2,000 (compile time independent of T)."""
    sizes = [kernel_sizes(fn, *args) for fn, args in (linear_kernel_program(mech, jnp.bfloat16, T=t) for t in (200, 2000))]
    assert len(sizes[0]) == {"gdn_backward": 3, "gla_backward": 2}[mech] and sizes[0] == sizes[1]


def test_swa_dots_run_at_full_fp32_precision():
    """Triton lowers an fp32 dot at the default precision to TF32; SWA's kernel asks for HIGHEST
    (IEEE fp32), which its fp32 tolerances need on a GPU."""
    fn, args = (lambda *a: swa.pallas(*a, sinks=8, window=56, interpret=False)), shapes(jnp.float32, 64)[:3]
    dots = kernel_dots(fn, *args)
    assert dots, "no dot found inside the kernel: the jaxpr walk is broken"
    precisions = {str(eqn.params["precision"]) for eqn in dots}
    assert precisions == {str((jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))}, precisions
