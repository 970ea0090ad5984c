"""The experiment file's sections, re-exported from linjax/experiment.py, where they moved so that
evaluation reads experiment files without importing training."""

from linjax.experiment import (
                               DTYPES,
                               EVALUATIONS,
                               GPU_LOSS_CHUNK,
                               OBJECTIVES,
                               OPERATIONAL,
                               REMAT_POLICY,
                               REMATS,
                               DataSection,
                               EvalSection,
                               ExperimentConfig,
                               ModelSection,
                               TrainSection,
                               apply_overrides,
                               check_list,
                               check_number,
                               check_text,
                               describe_changes,
                               flat_settings,
                               from_dict,
                               load_experiment,
                               matches,
                               setting_changes,
)

__all__ = ["DTYPES", "EVALUATIONS", "GPU_LOSS_CHUNK", "OBJECTIVES", "OPERATIONAL", "REMAT_POLICY", "REMATS",
           "DataSection", "EvalSection", "ExperimentConfig", "ModelSection", "TrainSection", "apply_overrides",
           "check_list", "check_number", "check_text", "describe_changes", "flat_settings", "from_dict",
           "load_experiment", "matches", "setting_changes"]
