"""Device mesh and shardings: one code path for one CPU, one GPU, or many hosts.

The mesh has two axes: `data` (batch split, parameters replicated) and `fsdp`
(batch split, frozen weights sharded). The logical rule for a weight is: shard
its largest axis that the fsdp size divides over `fsdp`, replicate the rest;
the few trainable parameters stay replicated. Batches are split over both
axes. With one device every sharding is trivial and the same jitted step runs.

Multi-host: start every process with the same command and
`JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i`;
`linjax train` then calls `jax.distributed.initialize()` and the mesh spans all
processes' devices.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linjax.scan import StackedLayers


def maybe_initialize_distributed():
    """`jax.distributed.initialize()` when the standard environment variables ask for it."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        # CPU processes need a collectives backend to talk to each other; GPUs use NCCL regardless.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["JAX_PROCESS_ID"]))


def make_mesh(data: int = -1, fsdp: int = 1) -> Mesh:
    devices = jax.devices()
    n = len(devices)
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"mesh_fsdp={fsdp} must divide the {n} available devices")
    if data == -1:
        data = n // fsdp
    if data * fsdp != n:
        raise ValueError(f"mesh_data × mesh_fsdp = {data} × {fsdp} must equal the {n} available devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def weight_spec(shape, fsdp_size: int) -> P:
    """Shard the largest axis that `fsdp_size` divides; replicate if none does."""
    if fsdp_size > 1:
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp_size == 0:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return P(*spec)
    return P()


def frozen_shardings(state, mesh: Mesh):
    """Where each frozen weight of `state` (arrays or ShapeDtypeStructs) lives on `mesh`: sharded by
    `weight_spec`; in a `StackedLayers` state, the layers' stacked weights by the rule for one layer's
    weight, never along the layer axis (each scan step reads one layer, so a sharded layer axis would
    move whole layers between devices). A tree like `state` of NamedShardings."""
    fsdp = mesh.shape["fsdp"]

    def spec(x, stacked=False):
        return NamedSharding(mesh, P(None, *weight_spec(x.shape[1:], fsdp)) if stacked else weight_spec(x.shape, fsdp))

    if isinstance(state, StackedLayers):
        return dataclasses.replace(state, runs=jax.tree.map(lambda x: spec(x, stacked=True), state.runs),
                                   rest=jax.tree.map(spec, state.rest))
    return jax.tree.map(spec, state)


def shard_frozen(state, mesh: Mesh):
    """The frozen weights placed as `frozen_shardings` says."""
    return jax.tree.map(jax.device_put, state, frozen_shardings(state, mesh))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicate(state, mesh: Mesh):
    return jax.tree.map(lambda x: jax.device_put(x, replicated_sharding(mesh)), state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def put_batch(batch: np.ndarray, mesh: Mesh):
    """The global batch (identical on every process) as an array split over the mesh."""
    devices = mesh.size
    if batch.shape[0] % devices:
        raise ValueError(f"batch_size={batch.shape[0]} must be a multiple of the {devices} devices in the mesh")
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])
