"""linjax: turn pretrained LLaMA/Qwen transformers into linear-time models, in JAX.

Public API:
    model, tokenizer = linjax.load("smollm2-135m")     # or an HF id / directory / .gguf / checkpoint
    logits = model(tokens)                              # int32 [batch, time] → [batch, time, vocab]
    linjax.save_hf(model, "out/")                       # back to a transformers directory
                                                        # (linearized: modeling code, trust_remote_code=True)
"""

import importlib.metadata as _metadata
import os as _os


def _avoid_known_cpu_miscompile():
    """jaxlib 0.10's XLA:CPU "ynn" fusion miscompiles chunked linear attention when the initial
    state is a constant built inside `jit` (outputs around 1e30, no error; found by our kernel
    tests at head dim 64). Turning that fusion off costs nothing measurable. It must be set before
    JAX creates its CPU backend, and only for the versions that have the flag."""
    try:
        version = _metadata.version("jaxlib")
    except _metadata.PackageNotFoundError:
        return
    flags = _os.environ.get("XLA_FLAGS", "")
    if version.startswith("0.10.") and "xla_cpu_experimental_ynn_fusion_type" not in flags:
        _os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=".strip()


_avoid_known_cpu_miscompile()

from linjax.config import ModelConfig  # noqa: E402
from linjax.generate import generate  # noqa: E402
from linjax.linearize import LinearizeConfig, linearize, trainable_parameter_count  # noqa: E402
from linjax.model import CausalLM, abstract_model, parameter_count  # noqa: E402

__version__ = "0.1.0"


def load(source, dtype="float32"):
    """(model, tokenizer) from `"smollm2-135m"`, a `.gguf` file, an HF directory or hub id, or a linjax checkpoint."""
    from linjax.convert.sources import load as _load

    return _load(source, dtype)


def save_hf(model, directory, tokenizer=None):
    """Writes `config.json` + `model.safetensors` (+ tokenizer) that `transformers` loads.

    A linearized model also gets `modeling_linjax.py`: load it with
    `AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`, no JAX needed."""
    from linjax.convert.hf import save_hf as _save_hf

    return _save_hf(model, directory, tokenizer)


__all__ = ["CausalLM", "LinearizeConfig", "ModelConfig", "abstract_model", "generate", "linearize",
           "parameter_count", "trainable_parameter_count", "load", "save_hf", "__version__"]
