"""Lower every Pallas kernel for CUDA with `jax.export` on this CPU machine.

The Triton backend builds the kernel's Triton IR while lowering, so a kernel
that uses an op Triton cannot express (a 3-D dot, a non-power-of-two tile, a
dynamic slice of a value) fails here instead of on a GPU. The Triton custom
call has no stable export guarantee, hence its disabled safety check.
Shapes: T not a multiple of the chunk, GQA (H = 4, Hkv = 2) and Dv = 128 (two
Dv blocks per head); bf16 and fp32. GLA, kGLA, linear attention and GDN run
chunk_pallas.py: the scores (and, for the delta rule, the solve), the state
pass and the outputs forward; through `jax.grad`, the reverse state pass and
the parallel gradient kernels.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax import export

from linjax.kernels import gdn, gla, kgla, swa
from linjax.linearize import LINEAR_MIXERS
from tests.helpers import linear_mechanisms

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


def registry_shapes(mech, dtype, D, T=T):
    """The shapes of the registry's example inputs of `mech` (its features, gates) at B, T, H, HKV, D."""
    make = lambda key: LINEAR_MIXERS[mech].example_inputs(key, B, T, H, HKV, D, dtype)  # noqa: E731
    return list(jax.eval_shape(make, jax.random.key(0)))


STATES_FWD, STATES_BWD = "linjax_chunk_states_fwd", "linjax_chunk_states_bwd"
FORWARD = ("linjax_chunk_scores", STATES_FWD, "linjax_chunk_output_fwd")
DELTA_FORWARD = ("linjax_chunk_scores", "linjax_chunk_solve_wy", STATES_FWD, "linjax_chunk_output_fwd")
BACKWARD = (STATES_BWD, "linjax_chunk_state_grads", "linjax_chunk_score_grads")
DELTA_BACKWARD = BACKWARD + ("linjax_chunk_wy_grads",)
def registry_case(mech):
    """(pallas function, input-shape settings, the Triton kernels its forward runs) for a mechanism of the
    registry: the delta rule's kernels (gdn.py) add the solve to the additive rule's."""
    mixer = LINEAR_MIXERS[mech]
    delta = mixer.kernel_module is gdn
    return (lambda *a: mixer.kernel_module.pallas(*a, interpret=False)), mech, DELTA_FORWARD if delta else FORWARD


CASES = {mech: registry_case(mech) for mech in linear_mechanisms()}


def triton_kernels(text):
    """The names of the Triton kernels an exported module calls, once each."""
    return {name for name in (*DELTA_FORWARD, *DELTA_BACKWARD) if name in text}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mech", list(CASES))
def test_linear_kernels_lower_to_triton(mech, dtype):
    fn, _, kernel_names = CASES[mech]
    text = exported_text(fn, *registry_shapes(mech, jnp.dtype(dtype), 128))
    assert text.count(TRITON_CALL) == len(kernel_names) and triton_kernels(text) == set(kernel_names)


@pytest.mark.parametrize("sinks, window", [(8, 56), (0, 64), (70, 5)])
def test_swa_lowers_to_triton(sinks, window):
    q, k, v = shapes(jnp.bfloat16, 128)[:3]
    fn = lambda *a: swa.pallas(*a, sinks=sinks, window=window, interpret=False)
    text = exported_text(fn, q, k, v)
    assert text.count(TRITON_CALL) == 1 and "linjax_swa_sinks_fwd" in text


@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gdn_backward_lowers_to_triton(dtype, scalar_gate):
    """jax.grad of gdn.pallas exports for CUDA with the forward kernels the gradient needs and every
    backward kernel as Triton calls: no XLA form of the chunk work is left in the gradient."""
    def loss(*args):
        o, state = gdn.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    args = shapes(jnp.dtype(dtype), 128, beta=True, scalar_gate=scalar_gate)
    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert triton_kernels(text) >= set(DELTA_BACKWARD) | {"linjax_chunk_scores", "linjax_chunk_solve_wy", STATES_FWD}


def gla_loss(*args):
    o, state = gla.pallas(*args[:4], initial_state=args[4], interpret=False)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)


def gla_grad_shapes(dtype, D):
    return [*shapes(dtype, D), jax.ShapeDtypeStruct((B, H, D, D), jnp.float32)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gla_backward_lowers_to_triton(dtype):
    args = gla_grad_shapes(jnp.dtype(dtype), 128)
    text = exported_text(jax.grad(gla_loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert triton_kernels(text) >= set(BACKWARD) | {"linjax_chunk_scores", STATES_FWD}
    assert "linjax_chunk_wy_grads" not in text


def test_kgla_backward_lowers_to_triton():
    def loss(*args):
        o, state = kgla.pallas(*args, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    text = exported_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *shapes(jnp.bfloat16, 64, beta=True))
    assert triton_kernels(text) >= set(BACKWARD)


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
    fn, _, _ = CASES[mech]
    return fn, registry_shapes(mech, dtype, 64, T=T)


LINEAR_KERNELS = [*CASES, "gla_backward", "gdn_backward"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mech", LINEAR_KERNELS)
def test_kernel_dots_take_the_model_dtype_and_accumulate_in_fp32(mech, dtype):
    """Every dot inside the chunked kernels accumulates in fp32. In a bf16 model, the dots of q, k, v,
    states and values take bf16 operands (tensor cores) at the default precision; fp32 operands (an fp32
    model, and the triangular solve and its gradient in any model) run as TF32×3, never as one TF32 pass
    (a 10-bit mantissa) nor as Triton's IEEE fp32 dot (CUDA cores, and register spills)."""
    fn, args = linear_kernel_program(mech, jnp.dtype(dtype))
    dots = kernel_dots(fn, *args, kernel="linjax_chunk")
    assert dots, "no dot found inside the kernels: the jaxpr walk is broken"
    bf16_dots = 0
    for eqn in dots:
        assert eqn.params["preferred_element_type"] == jnp.float32
        operands = {str(x.aval.dtype) for x in eqn.invars}
        if operands == {"bfloat16"}:
            bf16_dots += 1
            assert eqn.params["precision"] in (None, (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT))
        else:
            assert operands == {"float32"}
            assert eqn.params["precision"] == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert (bf16_dots > 0) == (dtype == "bfloat16")


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
    programs = (linear_kernel_program(mech, jnp.bfloat16, T=t) for t in (200, 2000))
    sizes = [kernel_sizes(fn, *args) for fn, args in programs]
    assert len(sizes[0]) >= {"gdn_backward": 7, "gla_backward": 5}[mech] and sizes[0] == sizes[1]


def test_swa_dots_run_at_full_fp32_precision():
    """Triton lowers an fp32 dot at the default precision to TF32; SWA's kernel asks for HIGHEST
    (IEEE fp32), which its fp32 tolerances need on a GPU."""
    fn, args = (lambda *a: swa.pallas(*a, sinks=8, window=56, interpret=False)), shapes(jnp.float32, 64)[:3]
    dots = kernel_dots(fn, *args)
    assert dots, "no dot found inside the kernel: the jaxpr walk is broken"
    precisions = {str(eqn.params["precision"]) for eqn in dots}
    assert precisions == {str((jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))}, precisions
