"""No chunked kernel may call XLA:CPU's LAPACK kernels, which can deadlock.

`jax.scipy.linalg.solve_triangular` lowers on CPU to the FFI call `lapack_strsm_ffi`, which
splits its batch into tasks on the same thread pool that runs the rest of the program and then
waits for them. Two such calls scheduled at once on a 2-core machine each hold one worker
thread and wait for tasks that no thread is left to run: the process sleeps forever. The first
test runs that situation (six independent chunked GDN calls at SmolLM2's shapes in one program)
in a subprocess pinned to two cores, under a timeout, so a regression fails instead of hanging
the suite; the old kernel stopped for good in its first call. The others read the lowered
programs of every chunked kernel and, for every mechanism, of a linearized model's training
gradient and decode step, for any LAPACK custom call.
"""

import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.kernels import gdn, gla, kgla, linear_attn, swa
from linjax.model import CausalLM
from tests.helpers import environment_with_user_xla_flags, python_environment, window_mechanisms

CONCURRENT_GDN = textwrap.dedent("""
    import os
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # XLA sizes its pool as on CI: 2 threads

    import jax, jax.numpy as jnp
    from linjax.kernels import gdn

    B, T, H, HKV, D = 1, 512, 9, 3, 64          # SmolLM2-135M's attention shapes

    def inputs(seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 5)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return (unit(jax.random.normal(ks[0], (B, T, H, D))), unit(jax.random.normal(ks[1], (B, T, HKV, D))),
                jax.random.normal(ks[2], (B, T, HKV, D)),
                jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, D)) + 2.0),
                jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))))

    calls = [inputs(seed) for seed in range(6)]
    program = jax.jit(lambda calls: sum(jnp.sum(gdn.chunked(*x)[0]) for x in calls))
    for i in range(30):
        program(calls).block_until_ready()
    print("finished", flush=True)
""")


def test_concurrent_chunked_gdn_calls_do_not_deadlock():
    env = python_environment(environment_with_user_xla_flags())  # compiled as users compile it
    try:
        done = subprocess.run([sys.executable, "-c", CONCURRENT_GDN], env=env, cwd=tempfile.gettempdir(),
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("six concurrent chunked GDN calls made no progress in 240 s: the XLA:CPU worker pool "
                    "deadlocked (a blocking LAPACK call in the kernel?)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished" in done.stdout


B, T, H, HKV, D = 1, 40, 4, 2, 16


def _arrays(*shapes):
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def _kernel_calls():
    q, k, v, la_chan, la_head, beta = _arrays((B, T, H, D), (B, T, HKV, D), (B, T, HKV, D), (B, T, H, D),
                                              (B, T, H), (B, T, H))
    la_chan, la_head, beta = jax.nn.log_sigmoid(la_chan), jax.nn.log_sigmoid(la_head), jax.nn.sigmoid(beta)
    return {
        "gdn per channel": lambda q, k, v: gdn.chunked(q, k, v, la_chan, beta),
        "gdn scalar": lambda q, k, v: gdn.chunked(q, k, v, la_head, beta),
        "gla": lambda q, k, v: gla.chunked(q, k, v, la_chan),
        "kgla": lambda q, k, v: kgla.chunked(q, k, v, la_chan, beta),
        "linear attention": lambda q, k, v: (lambda r: (r[0].o, r[1]))(
            linear_attn.chunked(jax.nn.softmax(q), jax.nn.softmax(k), v)),
        "sinks + window": lambda q, k, v: (swa.chunked(q, k, v, sinks=4, window=8),),
    }, (q, k, v)


def _lapack_calls(lowered) -> list[str]:
    text = lowered.as_text()
    return [line.strip() for line in text.splitlines() if "lapack" in line.lower()]


@pytest.mark.parametrize("name", list(_kernel_calls()[0]))
def test_chunked_kernels_lower_without_lapack(name):
    calls, args = _kernel_calls()
    loss = lambda *a: sum(jnp.sum(x) for x in jax.tree.leaves(calls[name](*a)))
    for program in (jax.jit(calls[name]), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        assert _lapack_calls(program.lower(*args)) == [], f"{name} lowers to a LAPACK call"


@pytest.mark.parametrize("mechanism", window_mechanisms())
def test_linearized_model_lowers_without_lapack(mechanism):
    """The hot paths of a linearized model: the training gradient and a decode step."""
    base = CausalLM(tiny_config("llama", num_hidden_layers=1), rngs=nnx.Rngs(0))
    adapter = None if mechanism == "window" else "shortconv"
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism=mechanism, window=8, sinks=4, adapter=adapter))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.zeros((1, 24), jnp.int32)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    def decode(params, token, states):
        return nnx.merge(graphdef, params, rest)(token, states=states)

    assert _lapack_calls(jax.jit(jax.grad(loss)).lower(params)) == []
    assert _lapack_calls(jax.jit(decode).lower(params, tokens[:, :1], model.init_states(1, 32))) == []
