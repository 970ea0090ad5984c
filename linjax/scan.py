"""Scan over layers: each run of identical decoder blocks is compiled once, not once per layer.

The model keeps one module per layer (conversion, export, linearization and the analysis code
address layers by index). At call time, consecutive blocks with the same structure and
parameter shapes are grouped into runs; each run's parameters are stacked along a new leading
axis and the run is one `jax.lax.scan` whose body is a single block. A pure linearized
SmolLM2 is one run of 30 layers; a hybrid that keeps some softmax layers gives a few runs.
XLA then compiles one block per run instead of 30 copies, which is most of the first-step
time and of the test suite's time.

The price is one copy of the stacked weights per call (about 0.4 GB for SmolLM2, tens of
milliseconds on a CPU): nothing next to a training step or a prefill, but more than a
one-token decode step of a small model, so `CausalLM` scans only calls without decoding
states unless asked (see `CausalLM.scan_layers`).

`remat` wraps the block in `jax.checkpoint`: "full" keeps only each block's input for the
backward pass (activation memory of one block instead of all), "dots" also keeps the
matmul outputs (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

REMAT_POLICIES = {
    "full": None,  # save nothing but the carry
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_runs(layers) -> list[list[int]]:
    """Consecutive layer indices whose blocks share structure and parameter shapes."""
    runs, previous = [], None
    for i, block in enumerate(layers):
        graphdef, state = nnx.split(block)
        signature = (graphdef, jax.tree.map(lambda a: (a.shape, a.dtype), state))
        if runs and signature == previous:
            runs[-1].append(i)
        else:
            runs.append([i])
        previous = signature
    return runs


def stack(trees):
    """One pytree whose leaves are the given trees' leaves stacked on a new axis 0."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree, count: int) -> list:
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(count)]


def run_layers(layers, x, positions, states=None, *, remat: str | None = None):
    """The blocks applied in order, each run of identical ones as one scan: x → x (and new states)."""
    if remat is not None and remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; choose one of {sorted(REMAT_POLICIES)} or None")
    new_states = None if states is None else []
    for run in layer_runs(layers):
        if len(run) == 1:  # nothing to share: call the block as it is
            block = layers[run[0]]
            if states is None:
                x = block(x, positions)
            else:
                x, state = block(x, positions, states[run[0]])
                new_states.append(state)
            continue
        graphdef = nnx.graphdef(layers[run[0]])
        params = stack([nnx.state(layers[i]) for i in run])
        run_states = None if states is None else stack([states[i] for i in run])

        def body(x, inputs, graphdef=graphdef):
            block = nnx.merge(graphdef, inputs[0])
            if inputs[1] is None:
                return block(x, positions), None
            return block(x, positions, inputs[1])

        if remat is not None:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
        x, run_new_states = jax.lax.scan(body, x, (params, run_states))
        if states is not None:
            new_states.extend(unstack(run_new_states, len(run)))
    return x, new_states
