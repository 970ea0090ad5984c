"""Scan over layers: each run of identical decoder blocks is compiled once, not once per layer.

The model keeps one module per layer (conversion, export, linearization and the analysis code
address layers by index). At call time, consecutive blocks with the same structure and
parameter shapes are grouped into runs; each run's parameters are stacked along a new leading
axis and the run is one `jax.lax.scan` whose body is a single block. A pure linearized
SmolLM2 is one run of 30 layers; a hybrid that keeps some softmax layers gives a few runs.
XLA then compiles one block per run instead of 30 copies, which is most of the first-step
time and of the test suite's time.

The price is one copy of the stacked weights per call (about 0.4 GB for SmolLM2, tens of
milliseconds on a CPU): nothing next to a prefill, but more than a one-token decode step of a
small model, so `CausalLM` scans only calls without decoding states unless asked (see
`CausalLM.scan_layers`). The training step does not pay it: it holds its parameters already
stacked (`StackedLayers`), and XLA folds the per-layer views back into the stack.

`remat` wraps the block in `jax.checkpoint`: "full" keeps only each block's input for the
backward pass (activation memory of one block instead of all), "dots" also keeps the
matmul outputs (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
"""

from __future__ import annotations

import dataclasses

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
    """The inverse of `stack`. By `jnp.split`, whose gradient is one concatenate that XLA folds
    into the scan's slicing (a slice per layer would transpose to a zero-padded copy of the whole
    stack per layer)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [jnp.split(leaf, count) for leaf in leaves]
    return [treedef.unflatten([part[i][0] for part in parts]) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class StackedLayers:
    """A model state (or a part of it, such as its trainable parameters) held stacked by layer run.

    `runs[r]` is the state of one block of run `layer_runs[r]` with every leaf stacked on a new
    leading axis over the run's layers; `rest` is everything outside the layers. The training
    step carries its parameters and optimizer moments in this form between steps: the optimizer
    then updates a few stacked leaves instead of a few hundred per-layer ones (330 for the final
    recipe on SmolLM2, each its own small fusion), and the scan receives its weights already
    stacked instead of copying them together at every call. `unstack_layers` inside the jitted
    step is free: XLA folds the split into the scan's stacking, and the gradient's concatenate
    into the scan's slicing. Checkpoints keep the per-layer form.
    """

    runs: tuple
    rest: nnx.State
    layer_runs: tuple


jax.tree_util.register_dataclass(StackedLayers, data_fields=["runs", "rest"], meta_fields=["layer_runs"])


def stack_layers(state: nnx.State, runs) -> StackedLayers:
    """`state` (its 'layers' entry indexed by layer, and others) with each run of layers stacked."""
    runs = tuple(tuple(run) for run in runs)
    layers = state.get("layers", {})
    rest = nnx.State({key: value for key, value in state.items() if key != "layers"})
    stacked = []
    for run in runs:
        present = [i for i in run if i in layers]
        if present and len(present) != len(run):
            raise ValueError(f"layers {list(run)} do not all hold this state's parameters: "
                             "they are not one run of identical blocks")
        stacked.append(stack([layers[i] for i in run]) if present else nnx.State({}))
    return StackedLayers(tuple(stacked), rest, runs)


def unstack_layers(stacked: StackedLayers) -> nnx.State:
    """The per-layer state again (the inverse of `stack_layers`)."""
    layers = {}
    for run, run_state in zip(stacked.layer_runs, stacked.runs):
        if jax.tree.leaves(run_state):
            layers.update(zip(run, unstack(run_state, len(run))))
    return nnx.State(_nested_dicts({**stacked.rest, "layers": dict(sorted(layers.items()))} if layers
                                   else stacked.rest))


def _nested_dicts(tree):
    """Nested States as the plain dicts that nnx.split puts below its top-level State."""
    if isinstance(tree, (nnx.State, dict)):
        return {key: _nested_dicts(value) for key, value in tree.items()}
    return tree


def per_layer(tree):
    """`tree` (e.g. an optimizer state) with every StackedLayers in it unstacked: the checkpoint form."""
    return jax.tree.map(lambda x: unstack_layers(x) if isinstance(x, StackedLayers) else x, tree,
                        is_leaf=lambda x: isinstance(x, StackedLayers))


def stacked_by_run(tree, runs):
    """`tree` with every nnx.State in it stacked by layer run (the inverse of `per_layer`)."""
    return jax.tree.map(lambda x: stack_layers(x, runs) if isinstance(x, nnx.State) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.State))


def run_layers(layers, x, positions, states=None, *, remat: str | None = None):
    """The blocks applied in order, each run of identical ones as one scan: x → x (and new states)."""
    if remat is not None and remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; choose one of {sorted(REMAT_POLICIES)} or None")
    new_states = None if states is None else []
    for run in layer_runs(layers):
        if len(run) == 1:  # nothing to share: call the block as it is
            block = layers[run[0]]
            if states is None and remat is not None:  # the same memory policy as the scanned runs
                graphdef, params = nnx.split(block)
                one_block = lambda params, x, graphdef=graphdef: nnx.merge(graphdef, params)(x, positions)  # noqa: E731
                x = jax.checkpoint(one_block, policy=REMAT_POLICIES[remat], prevent_cse=False)(params, x)
            elif states is None:
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
