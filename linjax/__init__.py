"""linjax: turn pretrained LLaMA/Qwen transformers into linear-time models, in JAX.

Public API:
    model, tokenizer = linjax.load("smollm2-135m")     # or an HF id / directory / .gguf / checkpoint
    logits = model(tokens)                              # int32 [batch, time] → [batch, time, vocab]
    linjax.save_hf(model, "out/")                       # back to a transformers directory
                                                        # (linearized: modeling code, trust_remote_code=True)
"""

from linjax.config import ModelConfig
from linjax.generate import generate
from linjax.linearize import LinearizeConfig, linearize, trainable_parameter_count
from linjax.model import CausalLM, abstract_model, parameter_count

__version__ = "0.1.0"


# The converters are imported on first use: they bring orbax and the file formats' libraries, which
# `import linjax` for modelling alone does not need.


def load(source, dtype="float32"):
    """(model, tokenizer) from `"smollm2-135m"`, a `.gguf` file, an HF directory or hub id, or a linjax checkpoint."""
    from linjax.convert.sources import load as _load

    return _load(source, dtype)


def save_hf(model, directory, tokenizer=None):
    """Writes `config.json` + `model.safetensors` (+ tokenizer) that `transformers` loads.

    A linearized model also gets `modeling_linjax.py`: load it with
    `AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`, no JAX needed."""
    from linjax.convert import export, hf

    if isinstance(model, CausalLM) and model.linearize_config is not None:
        return export.export_hf(model, directory, tokenizer)  # with its PyTorch modeling code
    return hf.save_hf(model, directory, tokenizer)


__all__ = ["CausalLM", "LinearizeConfig", "ModelConfig", "abstract_model", "generate", "linearize",
           "parameter_count", "trainable_parameter_count", "load", "save_hf", "__version__"]
