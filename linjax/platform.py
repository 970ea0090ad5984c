"""Which accelerator this process computes on, asked once and outside any traced function.

Code that differs by platform inside a traced function chooses with `jax.lax.platform_dependent`
(the platform the program is lowered for: a CUDA lowering made on a CPU machine is the program
a GPU runs). What cannot be chosen that way is resolved here, once, from the devices JAX has:
- whether cuDNN's fused attention can be traced at all (it asks the GPU for its compute
  capability while tracing, so it exists only on a machine with a CUDA device);
- the settings whose "auto" means "the GPU form on a GPU": `kernel = "auto"`, `model.dtype =
  "auto"`, `train.remat = "auto"`, `train.loss_chunk = "auto"`.
Both follow this process's devices unless a program is being built for another platform
(`compiling_for("cuda")`: a GPU program traced on a CPU machine, as bench/compile_gpu.py does).
"""

from __future__ import annotations

import contextlib
import functools

import jax


@functools.cache
def has_cuda() -> bool:
    """Whether JAX has a CUDA device in this process (False under JAX_PLATFORMS=cpu on a GPU machine)."""
    try:
        return bool(jax.devices("cuda"))
    except (RuntimeError, ValueError):  # no CUDA backend: not installed, or not among JAX_PLATFORMS
        return False


_TARGETS: list[str] = []  # the innermost compiling_for() platform, if any


@contextlib.contextmanager
def compiling_for(platform: str):
    """Within this block, the "auto" settings and the cuDNN choice resolve for `platform` ("cuda" or
    "cpu") rather than for the devices of this process. Programs built inside it must also be lowered
    for that platform (their arguments on its devices): the choice only changes what is traced."""
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"compiling_for takes 'cuda' or 'cpu'; got {platform!r}")
    _TARGETS.append(platform)
    try:
        yield
    finally:
        _TARGETS.pop()


def targets_cuda() -> bool:
    """Whether the program being built is for CUDA: the `compiling_for` platform, else whether this
    process has a CUDA device."""
    return _TARGETS[-1] == "cuda" if _TARGETS else has_cuda()


def device_description() -> str:
    """What this process computes on, for a run's history: "cpu", or the platform, count and kind of
    JAX's devices across every host, e.g. "gpu: 8 x NVIDIA H100 80GB HBM3"."""
    devices = jax.devices()
    if devices[0].platform == "cpu":
        return "cpu"
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    return f"{devices[0].platform}: {len(devices)} x {kinds}"


def resolve_kernel(kernel: str) -> str:
    """"auto" → "pallas" (the Triton kernels) with a CUDA device, else "chunked"; other names as given."""
    if kernel == "auto":
        return "pallas" if targets_cuda() else "chunked"
    return kernel


def resolve_dtype(dtype: str) -> str:
    """The frozen backbone's dtype: "auto" → "bfloat16" with a CUDA device (tensor cores, half the
    memory of an 8B model), else "float32" (XLA:CPU has no fast bf16 matmul)."""
    if dtype == "auto":
        return "bfloat16" if targets_cuda() else "float32"
    return dtype
