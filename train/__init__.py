"""Training the new parameters of a linearized model (the paper's frozen-backbone recipe).

    linjax train CONFIG.toml [--set section.key=value ...] [--resume]
    linjax.train.run(linjax.train.load_experiment("CONFIG.toml"))
"""

from linjax.experiment import ExperimentConfig, load_experiment
from linjax.train import loop
from linjax.train.loop import Stopped


def run(config, resume: bool = False, progress: bool = True, allow_changed_inputs: bool = False,
        load_finished: bool = True):
    """Trains per `config` (an ExperimentConfig or a TOML path); returns the trained model (see `loop.run`)."""
    if isinstance(config, str):
        config = load_experiment(config)
    return loop.run(config, resume=resume, progress=progress, allow_changed_inputs=allow_changed_inputs,
                    load_finished=load_finished)


__all__ = ["ExperimentConfig", "Stopped", "load_experiment", "run"]
