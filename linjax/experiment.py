"""Experiment files: TOML sections mapped onto frozen dataclasses, strictly.

    run_dir = "runs/smollm2-gdn"
    [model]      source, dtype ("auto": bfloat16 with a CUDA device, else float32)
    [linearize]  the fields of `linjax.LinearizeConfig`
    [data]       paths (files or folders) or dataset (a Hugging Face dataset name); deduplicate
    [train]      steps, seq_len, batch_size, lr, warmup_steps, seed, objective, ...
    [eval]       what `linjax run` evaluates after training (`linjax train` ignores it)

An unknown section or key is an error that names it. `--set section.key=value`
overrides are parsed as TOML values (`train.lr=1e-3`, `linearize.adapter="lora"`,
`data.paths=["a.txt"]`); a value that is not valid TOML is taken as a string.
Relative paths are relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import tomllib

from linjax.linearize import FLA_DEFAULT_SCALE, LEGACY_DEFAULTS, LinearizeConfig, adapter_parts
from linjax.platform import resolve_dtype, targets_cuda

OBJECTIVES = ("ce", "attention_transfer", "ce+attention_transfer", "distillation", "ce+distillation")
# train.trainable: which of the new parameters a run trains; the others keep the values they start with
# (fresh, or train.init_from's). "mechanism": the mechanism's own (feature maps, gates, β, output gain);
# "adapter": the adapter's only (LoRA, short conv). LoLCATs trains its feature maps in an attention-transfer
# stage, then only LoRA with cross-entropy.
TRAINABLE = ("all", "mechanism", "adapter")
SCHEDULES = ("cosine", "plateau")  # train/schedules.py
KEEPS = ("last", "best_validation")  # train.keep
DTYPES = ("auto", "float32", "bfloat16", "float16")
# train.remat: what the backward keeps of each decoder layer. "none": everything (fastest, memory
# grows with layers × T × the MLP width); "layer": each layer's matmul outputs, the rest
# recomputed; "full": only each layer's input, the whole layer recomputed in the backward (SmolLM2's
# final recipe at batch 4 × 4,096: about 43 GB of activations kept with "none", 4.7 GB with "full").
REMATS = ("auto", "none", "layer", "full")
REMAT_POLICY = {"none": None, "layer": "dots", "full": "full"}  # → CausalLM.remat (linjax/scan.py)
# train.loss_chunk: positions per piece of the LM head + cross-entropy; each piece's fp32 logits
# [B, chunk, V] are recomputed in the backward instead of kept (V = 128,256 for Llama 3).
GPU_LOSS_CHUNK = 1024


def check_number(name: str, value, *, integer: bool = False, at_least=None, above=None, optional: bool = False):
    """ValueError naming `name` unless `value` is a finite number (an integer if `integer`) ≥ `at_least` and
    > `above`; None passes when `optional`. TOML has nan, inf and booleans, and quotes make strings: all refused."""
    if value is None and optional:
        return
    kind = "an integer" if integer else "a finite number"
    bound = f" ≥ {at_least}" if at_least is not None else f" > {above}" if above is not None else ""
    valid = (isinstance(value, int) if integer else isinstance(value, (int, float))) and not isinstance(value, bool) \
        and math.isfinite(value) and (at_least is None or value >= at_least) and (above is None or value > above)
    if not valid:
        raise ValueError(f"{name} must be {kind}{bound}{' (or left out)' if optional else ''}, got {value!r}")


def check_text(name: str, value, *, optional: bool = False, choices=None):
    """ValueError naming `name` unless `value` is a string (one of `choices`, if given)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or (choices is not None and value not in choices):
        wanted = f"one of {list(choices)}" if choices is not None else "a string"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


def check_list(name: str, value, check_item) -> tuple:
    """`value` (a TOML list) as a tuple, each item passed to `check_item(item_name, item)`."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list like [...], got {value!r}")
    for i, item in enumerate(value):
        check_item(f"{name}[{i}]", item)
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    source: str = "smollm2-135m"  # HF id, HF directory, .gguf file, or "smollm2-135m"
    # Of the frozen backbone (and so of the activations); new parameters and the optimizer state are
    # always fp32. "auto" is resolved when the config is read: bfloat16 with a CUDA device, else float32.
    dtype: str = "auto"

    def __post_init__(self):
        check_text("model.source", self.source)
        check_text("model.dtype", self.dtype, choices=DTYPES)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class DataSection:
    paths: tuple[str, ...] = ()  # .txt, .jsonl, .json files or folders of them
    dataset: str | None = None  # a Hugging Face dataset, streamed (needs a network)
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    shuffle_buffer: int = 10_000  # streaming datasets only
    # Read each distinct document once (exact text; the first copy keeps its place). Off by default so
    # that runs recorded before it read what they read then (their configs lack the key).
    deduplicate: bool = False

    def __post_init__(self):
        object.__setattr__(self, "paths", check_list("data.paths", self.paths, check_text))
        for name in ("dataset", "dataset_config"):
            check_text(f"data.{name}", getattr(self, name), optional=True)
        check_text("data.split", self.split)
        check_text("data.text_field", self.text_field)
        check_number("data.shuffle_buffer", self.shuffle_buffer, integer=True, at_least=1)
        if not isinstance(self.deduplicate, bool):
            raise ValueError(f"data.deduplicate must be true or false, got {self.deduplicate!r}")
        if self.deduplicate and self.dataset:
            raise ValueError("data.deduplicate applies to local `paths`; a streamed `dataset` is read as it comes")
        if bool(self.paths) == bool(self.dataset):
            raise ValueError("[data] needs exactly one of `paths` (local files or folders) or `dataset` "
                             f"(a Hugging Face dataset name); got paths={list(self.paths)}, dataset={self.dataset!r}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The paper's recipe (appendix, hyperparameters) is the default."""

    steps: int = 2500
    seq_len: int = 4096
    batch_size: int = 1
    lr: float | None = None  # None: 2e-3, or 5e-4 with LoRA (the paper's two rates)
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1
    objective: str = "ce"
    trainable: str = "all"  # TRAINABLE
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    mesh_data: int = -1  # devices on the data axis (-1: all devices not used by fsdp)
    mesh_fsdp: int = 1  # devices the frozen weights are sharded over
    # A finished run directory whose trained parameters start this run (a fresh optimizer and
    # schedule): a second stage, e.g. cross-entropy after an attention-transfer stage.
    init_from: str | None = None
    # The learning rate's schedule (train/schedules.py): "cosine" (the paper's warm-up then cosine decay) or
    # "plateau" (Liger's: constant after the warm-up, cut 10x when the validation loss stalls).
    schedule: str = "cosine"
    # A validation set while training (train/validation.py): the first `validation_records` records of a
    # Clean-Alpaca JSON file (Liger's), scored every `validate_every` steps into RUN_DIR/validation.json.
    validation: str | None = None
    validation_records: int = 200
    validate_every: int = 200
    keep: str = "last"  # KEEPS: the parameters a finished run keeps, its last or its best validation's
    remat: str = "auto"  # REMATS; "auto": "full" with a CUDA device, else "none"
    loss_chunk: int | str = "auto"  # positions per LM-head piece; 0: all at once; "auto": 1,024 on CUDA, else 0

    def __post_init__(self):
        check_text("train.remat", self.remat, choices=REMATS)
        if self.loss_chunk != "auto" and not (isinstance(self.loss_chunk, int) and not isinstance(self.loss_chunk, bool)
                                              and self.loss_chunk >= 0):
            raise ValueError(f"train.loss_chunk must be \"auto\" or an integer ≥ 0 (0: the whole sequence at once), "
                             f"got {self.loss_chunk!r}")
        check_text("train.trainable", self.trainable, choices=TRAINABLE)
        if self.objective not in OBJECTIVES:
            raise ValueError(f"train.objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        for name in ("steps", "seq_len", "batch_size", "checkpoint_every", "keep_checkpoints", "mesh_fsdp"):
            check_number(f"train.{name}", getattr(self, name), integer=True, at_least=1)
        if self.seq_len < 2:
            raise ValueError("train.seq_len must be ≥ 2 (one token to predict from another)")
        check_number("train.warmup_steps", self.warmup_steps, integer=True, at_least=0)
        check_number("train.lr", self.lr, at_least=0, optional=True)  # 0: the parameters stay where they start
        check_number("train.weight_decay", self.weight_decay, at_least=0)
        check_number("train.grad_clip", self.grad_clip, at_least=0)  # 0: no clipping
        check_text("train.schedule", self.schedule, choices=SCHEDULES)
        check_text("train.validation", self.validation, optional=True)
        check_number("train.validation_records", self.validation_records, integer=True, at_least=1)
        check_number("train.validate_every", self.validate_every, integer=True, at_least=1)
        check_text("train.keep", self.keep, choices=KEEPS)
        for name, value, needs in (("schedule", self.schedule, "plateau"), ("keep", self.keep, "best_validation")):
            if value == needs and self.validation is None:
                raise ValueError(f"train.{name} = {value!r} reads a validation loss; set train.validation (a "
                                 "Clean-Alpaca JSON file, e.g. the data folder's "
                                 "alpaca/alpaca_data_cleaned_first5k.json)")
        check_number("train.seed", self.seed, integer=True, at_least=0)
        check_number("train.mesh_data", self.mesh_data, integer=True, at_least=-1)
        if self.mesh_data == 0:
            raise ValueError("train.mesh_data must be ≥ 1, or -1 for all devices not used by fsdp; got 0")
        check_text("train.init_from", self.init_from, optional=True)
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ValueError(f"train.warmup_steps must be in [0, steps={self.steps}) so the cosine decay has "
                             f"steps left; got {self.warmup_steps} (lower it with --set train.warmup_steps=N)")

    def remat_policy(self) -> str | None:
        """`CausalLM.remat` for this setting ("auto" resolved for the devices at hand)."""
        remat = ("full" if targets_cuda() else "none") if self.remat == "auto" else self.remat
        return REMAT_POLICY[remat]

    def loss_chunk_size(self) -> int | None:
        """Positions per LM-head piece (None: the whole sequence at once)."""
        chunk = (GPU_LOSS_CHUNK if targets_cuda() else 0) if self.loss_chunk == "auto" else self.loss_chunk
        return chunk or None

    def learning_rate(self, adapter: str | None) -> float:
        if self.lr is not None:
            return self.lr
        return 5e-4 if "lora" in adapter_parts(adapter) else 2e-3  # the paper lowers it for LoRA


EVALUATIONS = ("perplexity", "approx", "lm_eval", "ruler")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """The evaluations of `linjax run`. Data paths default to the project's data folder
    (`$LINJAX_DATA_DIR`, else ../shared/data); an evaluation whose data is missing is
    skipped and the report says so."""

    run: tuple[str, ...] = EVALUATIONS  # which evaluations, in this order
    perplexity_data: str | None = None  # default: WikiText-2 raw test
    perplexity_seq_len: int = 1024
    perplexity_windows: int | None = None  # None: the whole file
    approx_data: str | None = None  # default: Clean Alpaca (the paper's hold-out set)
    approx_num_seqs: int = 8
    approx_seq_len: int = 512
    lm_eval_tasks: tuple[str, ...] = ("piqa", "arc_easy", "hellaswag", "lambada_openai")
    lm_eval_limit: int | None = 100  # examples per task; None: all
    lm_eval_data_dir: str | None = None  # default: the data folder's local task files
    ruler_tasks: tuple[str, ...] = ("niah_single_1", "niah_single_2", "niah_single_3")
    ruler_lengths: tuple[int, ...] = (1024,)
    ruler_samples: int = 5
    ruler_budgets: tuple[int, ...] = ()  # cache budgets (sinks + window) to read the model at; (): as trained
    # Also evaluate the original model (lm-eval, S-NIAH) and the window-only baseline at the same
    # cache budget (S-NIAH), so the report compares the linearized model with both.
    compare: bool = True

    def __post_init__(self):
        for name in ("run", "lm_eval_tasks", "ruler_tasks"):
            object.__setattr__(self, name, check_list(f"eval.{name}", getattr(self, name), check_text))
        for name in ("ruler_lengths", "ruler_budgets"):
            object.__setattr__(self, name, check_list(
                f"eval.{name}", getattr(self, name),
                lambda item_name, item: check_number(item_name, item, integer=True, at_least=1)))
        for name, least in (("perplexity_seq_len", 2), ("approx_num_seqs", 1), ("approx_seq_len", 1),
                            ("ruler_samples", 1)):
            check_number(f"eval.{name}", getattr(self, name), integer=True, at_least=least)
        check_number("eval.perplexity_windows", self.perplexity_windows, integer=True, at_least=1, optional=True)
        check_number("eval.lm_eval_limit", self.lm_eval_limit, above=0, optional=True)
        for name in ("perplexity_data", "approx_data", "lm_eval_data_dir"):
            check_text(f"eval.{name}", getattr(self, name), optional=True)
        if not isinstance(self.compare, bool):
            raise ValueError(f"eval.compare must be true or false, got {self.compare!r}")
        unknown = sorted(set(self.run) - set(EVALUATIONS))
        if unknown:
            raise ValueError(f"eval.run: unknown evaluation(s) {unknown}; choose from {list(EVALUATIONS)}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    run_dir: str
    # A factory: ModelSection resolves dtype "auto" from the devices, which must not happen at import.
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    linearize: LinearizeConfig = LinearizeConfig()
    data: DataSection = DataSection(paths=("../shared/data/webtext",))
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()

    def __post_init__(self):
        if self.train.trainable == "adapter" and self.linearize.adapter is None:
            raise ValueError("train.trainable = \"adapter\" trains only the adapter's parameters, and [linearize] "
                             "has no adapter; set linearize.adapter (\"lora\" or \"shortconv\") or another "
                             f"train.trainable ({', '.join(TRAINABLE)})")

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "model": dataclasses.asdict(self.model),
                "linearize": self.linearize.to_dict(),
                "data": {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in dataclasses.asdict(self.data).items() if v is not None},
                "train": {k: v for k, v in dataclasses.asdict(self.train).items() if v is not None},
                "eval": {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in dataclasses.asdict(self.eval).items() if v is not None}}


# Settings that may differ between the start of a run and its resumption: where and how often it
# saves, how the same computation is sharded or which kernel computes it, and (for `linjax train`,
# which ignores them) the evaluations. Anything else changes the experiment. `train.steps` may
# change too (to extend a run); the run records it.
OPERATIONAL = ("run_dir", "train.steps", "train.checkpoint_every", "train.keep_checkpoints", "train.mesh_data",
               "train.mesh_fsdp", "train.remat", "train.loss_chunk", "linearize.kernel", "linearize.chunk", "eval")


def flat_settings(raw: dict) -> dict:
    """{"train.lr": 0.001, ...} from a config dict (ExperimentConfig.to_dict() or a stored config.json),
    JSON-normalised (tuples as lists) so a stored and a new config compare equal when they agree."""
    flat = {}
    for key, value in json.loads(json.dumps(raw)).items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def matches(key: str, prefixes) -> bool:
    """Whether `key` ("train.lr") is named by one of `prefixes`: a section ("train"), a key, or a key
    prefix ending in "_" ("eval.ruler_")."""
    return any(key == p or key.startswith(p + ".") or (p.endswith("_") and key.startswith(p)) for p in prefixes)


def setting_changes(old: dict, new: dict, ignore=()) -> dict:
    """{key: (old value, new value)} for every flat setting that differs, except those `ignore` names
    (see `matches`). A setting absent on one side has its default there (a run recorded before linjax
    had that setting used its default, or the one it had then if it has changed since:
    `LEGACY_DEFAULTS`), else None (e.g. lr unset)."""
    old, new = flat_settings(old), flat_settings(new)
    defaults = flat_settings(ExperimentConfig(run_dir="", data=DataSection(paths=("",))).to_dict())
    defaults.update({f"linearize.{key}": value for key, value in LEGACY_DEFAULTS.items()})
    changes = {}
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, defaults.get(key)), new.get(key, defaults.get(key))
        if before != after and not matches(key, ignore):
            changes[key] = (before, after)
    return changes


def describe_changes(changes: dict) -> str:
    """"train.lr 0.002 → 0.001, linearize.mechanism 'gdn' → 'gla'"."""
    text = ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changes.items())
    if changes.get("linearize.scale", (0, 0))[0] is None:  # a run from before the default moved to 1
        text += (f" (None is FLA's Dk^-1/2, linjax's default scale until it became 1; "
                 f"`scale = \"{FLA_DEFAULT_SCALE}\"` in [linearize] keeps it)")
    return text


_SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection, "eval": EvalSection}


def _build(cls, fields: dict, section: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown key{'s' if len(unknown) > 1 else ''} in [{section}]: "
                         f"{', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
    return cls(**fields)


def from_dict(raw: dict) -> ExperimentConfig:
    raw = dict(raw)
    unknown = sorted(set(raw) - {"run_dir", "model", "linearize", "data", "train", "eval"})
    if unknown:
        raise ValueError(f"unknown top-level key or section: {', '.join(unknown)}; "
                         "expected run_dir, [model], [linearize], [data], [train], [eval]")
    if "run_dir" not in raw:
        raise ValueError("the experiment needs `run_dir = \"...\"` (where checkpoints and metrics go)")
    run_dir = os.fspath(raw["run_dir"]) if isinstance(raw["run_dir"], os.PathLike) else raw["run_dir"]
    check_text("run_dir", run_dir)
    if not run_dir.strip():
        raise ValueError("run_dir is empty; name the folder for the run's checkpoints and metrics")
    kwargs: dict[str, Any] = {"run_dir": run_dir}
    for section in ("linearize", *_SECTIONS):
        if section in raw and not isinstance(raw[section], dict):
            hint = f'; e.g. [model] then source = "{raw[section]}"' if section == "model" else ""
            raise ValueError(f"`{section} = {raw[section]!r}` is a value, not a section: write [{section}] "
                             f"and its keys on the lines below it{hint}")
    for section, cls in _SECTIONS.items():
        if section in raw:
            kwargs[section] = _build(cls, raw[section], section)
    if "linearize" in raw:
        try:
            kwargs["linearize"] = LinearizeConfig.from_dict(raw["linearize"])
        except (ValueError, TypeError) as err:
            raise ValueError(f"[linearize]: {err}") from err
    return ExperimentConfig(**kwargs)


def _parse_value(text: str):
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`section.key=value` (or `run_dir=value`) assignments applied to a raw TOML dict."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) == 1:
            raw[parts[0]] = _parse_value(value)
        elif len(parts) == 2:
            raw.setdefault(parts[0], {})[parts[1]] = _parse_value(value)
        else:
            raise ValueError(f"--set key must be 'section.key', got {key!r}")
    return raw


def _merge(base: dict, extra: dict) -> dict:
    """`extra` deep-merged into `base` (sections merge key by key; later values win)."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no experiment file at {path!r}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from err


def load_experiment(path: str, overrides: list[str] | None = None, includes: list[str] | None = None
                    ) -> ExperimentConfig:
    """The experiment at `path`, with each `includes` fragment (e.g. from `linjax eval select-layers`)
    merged in, then the `--set` overrides applied."""
    raw = _read_toml(path)
    for fragment in includes or []:
        raw = _merge(raw, _read_toml(fragment))
    try:
        return from_dict(apply_overrides(raw, overrides or []))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from err
