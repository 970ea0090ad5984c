"""Training the new parameters of a linearized model (the paper's frozen-backbone recipe).

    linjax train CONFIG.toml [--set section.key=value ...] [--resume]
    linjax.train.run(linjax.train.load_experiment("CONFIG.toml"))
"""

from linjax.train import loop
from linjax.train.config import ExperimentConfig, load_experiment


def run(config, resume: bool = False, progress: bool = True):
    """Trains per `config` (an ExperimentConfig or a TOML path); returns the trained model."""
    if isinstance(config, str):
        config = load_experiment(config)
    return loop.run(config, resume=resume, progress=progress)


__all__ = ["ExperimentConfig", "load_experiment", "run"]
