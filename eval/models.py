"""What the `linjax eval` commands accept as MODEL, in one place.

    smollm2-135m, a .gguf file, an HF id or directory, a linjax checkpoint or a training
    run directory: whatever `linjax.load` reads (a run directory gives the trained model);
    an experiment TOML: the *untrained* linearized model that experiment starts from
    (its model source, linearize settings and seed), the "before training" row of a table.
"""

from __future__ import annotations

import linjax
from linjax.experiment import load_experiment


def load_model(spec: str, dtype: str = "float32"):
    """(model, tokenizer, description) for a MODEL argument."""
    if spec.endswith(".toml"):
        experiment = load_experiment(spec)
        model, tokenizer = linjax.load(experiment.model.source, dtype=dtype)
        model = linjax.linearize(model, experiment.linearize, seed=experiment.train.seed)
        return model, tokenizer, f"{spec} (linearized, untrained, seed {experiment.train.seed})"
    model, tokenizer = linjax.load(spec, dtype=dtype)
    return model, tokenizer, spec
