"""Compile a JAX program for an NVIDIA GPU on a machine without one, and say what it would cost there.

XLA's GPU compiler does not need a GPU, a driver or libcuda: the CUDA PJRT plugin offers a
compile-only topology built from a target description (a `GpuTargetConfigProto`), and a function
lowered with its arguments placed on those devices compiles end to end (HLO passes, Triton for the
Pallas kernels, LLVM to PTX, ptxas), exactly as on the card. What comes back is measured here:

    compile time   wall seconds of `compile()`, and XLA's own split (HLO passes, backend, LLVM → PTX,
                   ptxas; the last two summed over XLA's compile threads)
    memory         `memory_analysis()`: arguments + outputs − aliased + temporaries, against the whole
                   card and against JAX's default pool (75 % of it); XLA's "cannot fit" warnings
    kernels        every launch of the program (XLA's thunk sequence: grid, threads, shared memory)
                   and, for the Pallas kernels, ptxas' registers and spilled bytes
    T × T tensors  any buffer in the optimised HLO with two axes of at least the sequence length

Needs JAX's CUDA plugin beside a matching jaxlib (`pip install ".[gpu-aot]"`, in an environment of its
own: docs/gpu.md), and a process whose environment, before jax is imported, has (bench/compile_gpu.py
sets them) JAX_PLATFORMS=cpu, so the plugin does not try to initialise CUDA (there is no
driver) while its compile-only topology still registers, and XLA's log of its compile phases and of
ptxas' resource usage (TF_CPP_MIN_LOG_LEVEL=0, TF_CPP_VMODULE=gpu_compiler=1,nvptx_compiler=1,
subprocess_compilation=2), which is where the timings and registers are read from.

No autotuning happens without a GPU: GEMM fusions get XLA's default tiling, so a compile on a card
may pick other kernels and take longer (it autotunes). Memory excludes the CUDA context and
fragmentation.

    card = TARGETS["h100"]
    mesh = gpu_mesh(card, (1,), ("x",))
    result = compile_for_gpu("name", jax.jit(f), abstract_args, mesh, card, sequence_length=4096)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

GiB = 2 ** 30
# JAX's default GPU allocator takes this fraction of the card (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_POOL_FRACTION = 0.75
# Kernels written in this project are named linjax_* (pallas_call(name=...)); XLA names its own fusions.
OWN_KERNEL_PREFIX = "linjax_"


@dataclasses.dataclass(frozen=True)
class Card:
    """What XLA needs to know of a GPU to compile for it. Figures: NVIDIA's H100 / H200 datasheets
    (SMs, memory, bandwidth) and the CUDA programming guide's compute capability 9.0 limits (shared
    memory, registers); the field layout is XLA's `GpuTargetConfigProto`, whose full descriptions of
    these cards are in XLA's xla/backends/gpu/target_config/specs/ (h100_sxm.txtpb, h200.txtpb)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: int
    sms: int = 132
    l2_bytes: int = 50 * 2 ** 20
    clock_ghz: float = 1.98
    cudnn: tuple[int, int, int] = (9, 10, 0)

    def target_config(self) -> str:
        major, minor, patch = self.cudnn
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.bandwidth_bytes_per_s}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}
device_description_str: "{self.name}"
"""


TARGETS = {
    # device_memory_size as the CUDA driver reports it for each card (XLA's specs carry the same figure).
    "h100": Card("NVIDIA H100 80GB HBM3", memory_bytes=84_942_979_072, bandwidth_bytes_per_s=3_352_320_000_000),
    "h200": Card("NVIDIA H200 141GB HBM3e", memory_bytes=151_397_597_184, bandwidth_bytes_per_s=4_800_000_000_000),
}


def _answer_cudnn_for_compute_capability_9_0():
    """JAX's cuDNN attention asks the process's default backend for the GPU's compute capability while
    tracing (and, below 9.0, refuses sequence lengths that are not multiples of 64). Here that backend is
    the CPU, so the question is answered for the target cards, all compute capability 9.0."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    capability = lambda text: tuple(int(x) for x in text.split("."))  # noqa: E731
    cudnn_attention.check_compute_capability = lambda wanted: capability(wanted) <= (9, 0)
    cudnn_attention.is_cuda_compute_capability_equal = lambda wanted: capability(wanted) == (9, 0)


@functools.cache
def gpu_devices(target: str, count: int = 1) -> tuple:
    """`count` compile-only devices of the card TARGETS[target] (one topology per (target, count):
    devices of two topologies do not mix in one program)."""
    _answer_cudnn_for_compute_capability_9_0()
    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target].target_config(),
                                            topology=f"1x1x{count}")
    return tuple(topology.devices)


def gpu_mesh(target: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    """A mesh of compile-only devices of `target`, e.g. gpu_mesh("h100", (1, 8), ("data", "fsdp"))."""
    devices = gpu_devices(target, int(np.prod(shape)))
    return Mesh(np.asarray(devices).reshape(shape), axis_names)


def on_mesh(tree, mesh: Mesh, spec_of=None):
    """Every leaf with a shape and dtype as a ShapeDtypeStruct on `mesh`, sharded by `spec_of(leaf)`
    (a PartitionSpec; default: the spec of its own NamedSharding if it has one, else replicated)."""
    def place(x):
        if spec_of is not None:
            spec = spec_of(x)
        else:
            sharding = getattr(x, "sharding", None)
            spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(place, tree)


# ----------------------------------------------------------------------------------- XLA's log


@contextlib.contextmanager
def captured_stderr():
    """File descriptor 2 (XLA's C++ log) into a temporary file; yields a function returning its text."""
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        text = []
        try:
            yield lambda: "".join(text)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode("utf-8", "replace"))


_MICROSECONDS = r"\((\d+) us\)"
_PHASES = {"hlo_passes_s": r"GpuCompiler::RunHloPasses for \S+ time: .*?" + _MICROSECONDS,
           "backend_s": r"GpuCompiler::RunBackend for \S+ time: .*?" + _MICROSECONDS,
           "llvm_to_ptx_s": r"CompileToPtx for \S+ time: .*?" + _MICROSECONDS,
           "ptxas_s": r"PtxToCubin for \S+ time: .*?" + _MICROSECONDS}


def compile_phases(log: str) -> dict[str, float]:
    """XLA's phase timers, in seconds (LLVM and ptxas summed over its parallel compile threads)."""
    phases = {}
    for key, pattern in _PHASES.items():
        found = [int(v) for v in re.findall(pattern, log)]
        if found:
            phases[key] = sum(found) / 1e6
    return phases


def ptxas_usage(log: str) -> dict[str, dict]:
    """Per entry function: registers, spilled bytes (stores) and ptxas' milliseconds, from `ptxas -v`."""
    kernels, current = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)' for 'sm_", line)
        if entry:
            current = kernels.setdefault(entry.group(1), {})
            continue
        if current is None:
            continue
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spills:
            current["spill_bytes"] = int(spills.group(1))
        registers = re.search(r"Used (\d+) registers", line)
        if registers:
            current["registers"] = int(registers.group(1))
        ptxas_ms = re.search(r"Compile time = ([\d.]+) ms", line)
        if ptxas_ms:
            current["ptxas_ms"] = float(ptxas_ms.group(1))
            current = None
    return kernels


def xla_warnings(log: str) -> list[str]:
    """XLA's warnings (e.g. rematerialization's "Can't reduce memory use below ...": it cannot fit)."""
    return [re.sub(r"^W\d{4} [\d:.]+\s+\d+ \S+\] ", "", line) for line in log.splitlines()
            if re.match(r"^W\d{4} ", line)]


def launches(dump_dir: str) -> list[dict]:
    """Every kernel launch of the program, from XLA's thunk sequence: name, grid, threads, shared bytes."""
    found = []
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith("thunk_sequence.txt"):
            continue
        with open(os.path.join(dump_dir, name)) as f:
            for line in f:
                m = re.search(r"\]\s+(\S+)\s+grid: \[([^\]]*)\] threads: \[([^\]]*)\]\s+shared_memory: (\d+) bytes",
                              line)
                if m:
                    found.append(dict(name=m.group(1), grid=[int(x) for x in m.group(2).split(",") if x.strip()],
                                      threads=[int(x) for x in m.group(3).split(",") if x.strip()],
                                      shared_bytes=int(m.group(4))))
    return found


_TENSOR_TYPE = re.compile(r"\b(?:f32|bf16|f16|s32|pred|f64|u8|s8)\[([\d,]+)\]")


def sequence_squares(hlo_text: str, length: int) -> list[str]:
    """Shapes in optimised HLO text with two axes of the sequence's length (or one less: the next-token
    shift): a score or probability matrix over the whole sequence, which no training program of linjax
    may hold."""
    found = set()
    for dims in _TENSOR_TYPE.findall(hlo_text):
        shape = [int(d) for d in dims.split(",")]
        if sum(d in (length - 1, length) for d in shape) >= 2:
            found.add("x".join(map(str, shape)))
    return sorted(found)


# ------------------------------------------------------------------------------------ compiling


def compile_for_gpu(program: str, jitted, args: tuple, target: str, *, sequence_length: int | None = None,
                    kwargs: dict | None = None, options: dict | None = None) -> dict:
    """Lower `jitted(*args, **kwargs)` (abstract arguments already placed on compile-only devices of
    `target`) and compile it for that card. Returns a JSON-ready record of what it would cost there;
    a compile that fails (a kernel over the shared-memory limit, say) is a record with an `error`."""
    card = TARGETS[target]
    record = dict(program=program, target=target, card=card.name, jax=jax.__version__)
    dump = tempfile.mkdtemp(prefix="linjax-deviceless-")
    try:
        start = time.perf_counter()
        lowered = jitted.trace(*args, **(kwargs or {})).lower()
        record["trace_lower_s"] = round(time.perf_counter() - start, 3)
        with captured_stderr() as log:
            start = time.perf_counter()
            try:
                compiled = lowered.compile({"xla_dump_to": dump, **(options or {})})
                error = None
            except Exception as e:  # the record says why; the caller decides what failure means
                compiled, error = None, e
            record["compile_s"] = round(time.perf_counter() - start, 3)
        text = log()
        if "deviceless compilation" not in text and error is None:
            raise RuntimeError(f"{program}: XLA did not compile deviceless for {card.name}: the arguments are not "
                               "on its compile-only devices")
        record["phases"] = compile_phases(text)
        record["xla_warnings"] = xla_warnings(text)
        if error is not None:
            lines = [line for line in str(error).splitlines() if line.strip()]
            record["error"] = f"{type(error).__name__}: {(lines[0] if lines else '')[:400]}"
            return record
        record.update(_memory(compiled, card))
        usage = ptxas_usage(text)
        thunks = launches(dump)
        record["launches"] = len(thunks)
        record["distinct_kernels"] = len({t["name"] for t in thunks})
        own = {}
        for t in thunks:
            if t["name"].startswith(OWN_KERNEL_PREFIX) and t["name"] not in own:
                own[t["name"]] = dict(name=t["name"], grid=t["grid"], threads=t["threads"],
                                      shared_bytes=t["shared_bytes"], **usage.get(t["name"], {}))
        record["pallas_kernels"] = list(own.values())
        xla_made = [dict(name=n, **u) for n, u in usage.items() if not n.startswith(OWN_KERNEL_PREFIX)]
        record["ptxas_s_by_kind"] = _ptxas_by_kind(usage)
        record["xla_kernel_spills"] = [k for k in xla_made if k.get("spill_bytes")]
        record["max_xla_registers"] = max((k.get("registers", 0) for k in xla_made), default=0)
        if sequence_length:
            record["sequence_squares"] = sequence_squares(compiled.as_text(), sequence_length)
        return record
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def _ptxas_by_kind(usage: dict) -> dict[str, float]:
    """ptxas seconds summed by kind of kernel: this project's Pallas kernels, XLA's Triton GEMM fusions,
    and XLA's other fusions (where a compile's time goes)."""
    kinds = {}
    for name, u in usage.items():
        kind = "pallas" if name.startswith(OWN_KERNEL_PREFIX) else "triton_gemm" if "gemm" in name else "xla_fusion"
        kinds[kind] = round(kinds.get(kind, 0.0) + u.get("ptxas_ms", 0.0) / 1e3, 3)
    return kinds


def _memory(compiled, card: Card) -> dict:
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    return dict(argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
                alias_bytes=stats.alias_size_in_bytes, temp_bytes=stats.temp_size_in_bytes, total_bytes=total,
                fits=dict(card=total <= card.memory_bytes, pool=total <= DEFAULT_POOL_FRACTION * card.memory_bytes))


def problems(record: dict) -> list[str]:
    """What makes a compiled program unfit for the card, in words: a failed compile, a Pallas kernel
    that spills registers, a program that does not fit JAX's default pool, a sequence-square tensor."""
    if "error" in record:
        return [f"does not compile: {record['error']}"]
    found = [f"{k['name']} spills {k['spill_bytes']} bytes of registers" for k in record["pallas_kernels"]
             if k.get("spill_bytes")]
    if not record["fits"]["pool"]:
        found.append(f"needs {record['total_bytes'] / GiB:.1f} GiB, over JAX's default pool of "
                     f"{DEFAULT_POOL_FRACTION * TARGETS[record['target']].memory_bytes / GiB:.1f} GiB")
    if isinstance(record.get("sequence_squares"), list) and record["sequence_squares"]:
        found.append(f"holds sequence-square tensors {record['sequence_squares'][:3]}")
    return found
