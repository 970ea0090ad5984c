"""Replace softmax attention with a linear mechanism, layer by layer, keeping the pretrained weights.

    model = linjax.linearize(model, linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8,
                                                           adapter="shortconv"))

The pretrained projections are shared with the new mixers, not copied; the only
new parameters are the mechanism's (gates, β, feature maps) and the adapter's,
all of type `linjax.layers.Trainable`, which is what training optimises.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil

import jax
from flax import nnx

import linjax.mixers
from linjax.kernels import retention
from linjax.layers import Trainable
from linjax.mixers.linear import LinearMixer
from linjax.mixers.softmax import SoftmaxAttention
from linjax.platform import resolve_kernel


def find_mixers() -> dict[str, type]:
    """{mechanism name: mixer class} for every class in linjax/mixers/ that names its `mechanism`.

    Each mechanism's module declares itself (its class's `mechanism` attribute), so adding a
    mechanism needs no edit here. The registry is the one list of mechanisms: LinearizeConfig,
    the CLI, the export (convert/export.py) and the tests' mechanism grids read it, and a linear
    mixer brings what tests and benchmarks need (`kernel_module`, `fla_kernel`, `example_inputs`).
    """
    found = {}
    for module_info in sorted(pkgutil.iter_modules(linjax.mixers.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{linjax.mixers.__name__}.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and vars(value).get("mechanism"):
                if value.mechanism in found:
                    raise TypeError(f"{found[value.mechanism].__name__} and {value.__name__} both name the "
                                    f"mechanism {value.mechanism!r}")
                found[value.mechanism] = value
    return found


MIXERS = find_mixers()
# The linear mechanisms (LinearMixer subclasses: a kernel module and a state), in MIXERS' order.
LINEAR_MIXERS = {name: mixer for name, mixer in MIXERS.items() if issubclass(mixer, LinearMixer)}
ADAPTERS = (None, "shortconv", "lora", "shortconv+lora")
COMBINES = ("sum", "mixed")
CONV_INITS = ("torch", "identity")
# GLA's decay gate: the paper's low-rank projection of h, or Liger's, read from the key projection.
GATES = ("low_rank", "liger_pooled_key")
# What GLA's kernel reads of q and k: L2-normalised (the paper's) or a softmax over the head dimension (Liger's).
FEATURE_MAPS = ("l2", "softmax")
LORA_TARGETS = ("q", "k", "v", "o")
KERNELS = ("auto", "chunked", "pallas")
RETAIN_SCORES = retention.SCORES


def adapter_parts(adapter: str | None) -> set[str]:
    """The adapters a setting names: "shortconv+lora" is both."""
    return set((adapter or "").split("+")) - {""}


# `scale = "fla_default"`: FLA's kernels' output scale, Dk^-1/2 (stored as None).
FLA_DEFAULT_SCALE = "fla_default"

# Settings whose default changed, with the value they had before: what a config saved without the
# setting was run with, so it loads as it was trained. `scale`: FLA's Dk^-1/2 before, 1 now
# (results/README.md, "Output scale").
LEGACY_DEFAULTS = {"scale": None}


@dataclasses.dataclass(frozen=True)
class LinearizeConfig:
    """How to linearize: the paper's final recipe is GDN + window 56 + 8 sinks + short conv.

    mechanism: gla | kgla | gdn (Kimi, per-channel gate) | gdn_scalar | hedgehog | softmax (no change)
        | window (sinks + window softmax with no linear term: the training-free fixed-budget baseline)
    window, sinks: exact softmax over the first `sinks` tokens and the last `window` ones; the
        linear state covers the rest ("SWA 64" is window=64, sinks=0; 0/0 is pure linear attention).
    combine: "sum" (the paper's disjoint sum) or "mixed" (Liger's 0.5 · linear + 0.5 · window).
    adapter: None, "shortconv" (kernel 8 on q, k, v), "lora" (rank 8, alpha 16 on q/k/v/o) or
        "shortconv+lora" (both: e.g. LoRA added in a second stage to a run trained with the short conv).
    conv_on_window: with the short conv, the sinks + window softmax also reads the convolved
        q, k, v; by default (False, the paper's) the short conv feeds only the linear part.
    conv_init: the short conv's start: "torch" (PyTorch's Conv1d default, as the paper and FLA) or
        "identity" (the current token's tap 1, the rest 0), which leaves the pretrained q, k, v unchanged.
    keep_full_attention: layer indices kept as softmax attention, or a fraction of the layers
        spread uniformly over depth.
    kernel: "auto" (the default: "pallas" when JAX has a CUDA device, else "chunked"), "chunked"
        (pure JAX, any backend) or "pallas" (GPU kernels; interpreted on CPU). "auto" is kept as
        written in saved settings and resolved by each process, so a model trained on a GPU loads
        on a CPU with the XLA kernels.
    scale: the linear term's output scale, y = scale · qᵀS. Default 1, the paper's y = qᵀS: pure
        GDN learns at 1 and not at Dk^-1/2 (results/README.md, "Output scale").
        "fla_default" (None in Python): FLA's kernels' default, Dk^-1/2 for GLA, kGLA, GDN and
        gdn_scalar (1 for Hedgehog); a saved config without a scale, or with null, was trained
        with it and still loads so (`LEGACY_DEFAULTS`).
    output_gain: a learned per-head gain (initialised to 1) on the linear term, one new
        parameter per head and layer.
    output_gain_init: the gains' start (> 0; needs output_gain). For Hedgehog with a window it
        weighs the linear part's attention mass against the window's: LoLCATs starts its window
        factor at 0.1, which is a gain of 10 (configs/claims/lolcats-at.toml).
    gate_bias: the decay gate's bias at initialisation (GLA, kGLA, GDN, gdn_scalar): 1 as in the
        paper, so α ≈ sigmoid(1) ≈ 0.73 at the start (a memory of about four tokens); larger values
        start with a longer memory (3: α ≈ 0.95, about twenty tokens).
    gate: GLA's decay gate. "low_rank" (the paper's, with `gate_rank` and `gate_bias`) or
        "liger_pooled_key" (Liger-GLA's: log α = LogSigmoid(pool(k_proj(h))) / 16 from the frozen,
        LoRA-adapted key projection, no parameters of its own; linjax/mixers/gla.py).
    retain: tokens kept for their content per layer and kv head, beside the sinks and the window
        (docs/retention.md): a token leaving the window takes a slot if one is free or it
        scores above the weakest retained token, and the token that loses (or never wins) a slot goes
        into the linear state. 0 (the default) is the final recipe as it was. No new parameters, so
        any trained run can be read with it; with it on, every mode runs token by token.
    retain_score: what a leaving token is scored by: "recall" (LoLA's self-recall error
        ‖v − Sᵀk‖ / ‖v‖ against the state it would enter), "key_norm" (‖k‖, no state needed) or
        "attention" (the softmax mass it received while in the window, as H2O / SnapKV).
    feature_map: what GLA's kernel reads of q and k: "l2" (the default, the paper's L2 normalisation)
        or "softmax" (Liger-GLA's softmax over the head dimension; with `linear_rope` false, as Liger).
    linear_rope: whether the linear part's q and k carry RoPE (the default, as the window's do). False:
        they are taken before RoPE (Liger-GLA applies RoPE only to the window softmax's copies).
    state_covers_window: False (the default, the paper's disjoint split): the linear state holds the
        tokens that have left the sinks and the window. True: it holds every token, those in the window
        included (Liger-GLA's, whose GLA runs over the whole sequence beside the window softmax).
    lora_targets: the projections LoRA adapts, of "q", "k", "v", "o" (all four by default, as
        LoLCATs; Liger-GLA adapts q, k and v).
    retain_block: 1 (the default) chooses the retained tokens token by token; C > 1 (at most the
        window) a block of C at a time: the window is block-aligned (each query of a block sees
        between w − C + 1 and w recent tokens), the C tokens leaving it at a block boundary compete
        with the retained ones at once, and every mode scans blocks instead of tokens, so training
        and prefill with retained tokens run about C times fewer sequential steps.
    """

    mechanism: str = "gdn"
    window: int = 56
    sinks: int = 8
    combine: str = "sum"
    adapter: str | None = None
    conv_on_window: bool = False
    keep_full_attention: tuple[int, ...] | float = ()
    gate_rank: int = 16
    conv_kernel: int = 8
    conv_init: str = "torch"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    chunk: int | None = None  # the kernels' chunk length; None: each kernel's own default
    kernel: str = "auto"
    scale: float | str | None = 1.0
    output_gain: bool = False
    output_gain_init: float = 1.0
    gate_bias: float = 1.0
    gate: str = "low_rank"
    retain: int = 0
    retain_score: str = "recall"
    retain_block: int = 1
    feature_map: str = "l2"
    linear_rope: bool = True
    state_covers_window: bool = False
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if self.adapter in ("none", ""):  # TOML and the CLI have no None
            object.__setattr__(self, "adapter", None)
        if self.mechanism not in MIXERS:
            raise ValueError(f"unknown mechanism {self.mechanism!r}; choose one of {sorted(MIXERS)}")
        if self.adapter not in ADAPTERS:
            raise ValueError(f"unknown adapter {self.adapter!r}; choose None, 'shortconv', 'lora' or "
                             "'shortconv+lora'")
        if self.conv_init not in CONV_INITS:
            raise ValueError(f"unknown conv_init {self.conv_init!r}; choose 'torch' or 'identity'")
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; choose one of {list(GATES)}")
        if self.gate != "low_rank" and self.mechanism != "gla":
            raise ValueError(f"gate={self.gate!r} is a GLA gate; use mechanism='gla' or gate='low_rank'")
        if self.combine not in COMBINES:
            raise ValueError(f"unknown combine {self.combine!r}; choose 'sum' or 'mixed'")
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; choose 'auto', 'chunked' or 'pallas'")
        if self.window < 0 or self.sinks < 0:
            raise ValueError(f"window and sinks must be ≥ 0, got window={self.window}, sinks={self.sinks}")
        if self.sinks and not self.window:
            raise ValueError(f"sinks={self.sinks} need a window ≥ 1 (the current token is always attended "
                             "exactly); use window ≥ 1, or sinks=0 for pure linear attention")
        if self.mechanism == "window" and not self.window:
            raise ValueError("mechanism='window' attends only to the sinks and the window; it needs window ≥ 1")
        if self.mechanism == "window" and self.adapter is not None:
            raise ValueError(f"mechanism='window' has no linear part for the {self.adapter!r} adapter to act on; "
                             "use adapter=None")
        if not isinstance(self.conv_on_window, bool):
            raise ValueError(f"conv_on_window must be true or false, got {self.conv_on_window!r}")
        if self.conv_on_window and (not self.uses_shortconv or not self.window):
            raise ValueError("conv_on_window=True feeds the short conv's q, k, v to the window softmax: it needs "
                             f"the short conv (adapter='shortconv' or 'shortconv+lora') and window ≥ 1 "
                             f"(got adapter={self.adapter!r}, window={self.window})")
        if self.combine == "mixed" and not self.window:
            raise ValueError("combine='mixed' mixes the linear and window parts; it needs window ≥ 1")
        for name in ("gate_rank", "conv_kernel", "lora_rank", "chunk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not (isinstance(self.gate_bias, (int, float)) and not isinstance(self.gate_bias, bool)
                and math.isfinite(self.gate_bias)):
            raise ValueError(f"gate_bias must be a finite number, got {self.gate_bias!r}")
        if not (isinstance(self.retain, int) and not isinstance(self.retain, bool)) or self.retain < 0:
            raise ValueError(f"retain must be an integer ≥ 0 (retained tokens per layer and kv head), "
                             f"got {self.retain!r}")
        if self.retain_score not in RETAIN_SCORES:
            raise ValueError(f"unknown retain_score {self.retain_score!r}; choose one of {list(RETAIN_SCORES)}")
        if self.retain and (not self.window or self.mechanism in ("softmax", "window")):
            raise ValueError(f"retain={self.retain} keeps tokens that leave the window and writes the rest into a "
                             f"linear state: it needs window ≥ 1 and a linear mechanism (got mechanism="
                             f"{self.mechanism!r}, window={self.window})")
        block = self.retain_block
        if not (isinstance(block, int) and not isinstance(block, bool)) or block < 1 or \
                (block > 1 and not (self.retain and block <= self.window)):
            raise ValueError(f"retain_block must be an integer ≥ 1, and > 1 needs retain > 0 and window ≥ retain_block "
                             f"(got retain_block={self.retain_block!r}, retain={self.retain}, window={self.window})")
        if self.scale == FLA_DEFAULT_SCALE:  # TOML and the CLI have no None
            object.__setattr__(self, "scale", None)
        if self.scale is not None:
            number = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
            if not number or not 0 < self.scale < math.inf:
                raise ValueError(f"scale must be a finite number > 0, or {FLA_DEFAULT_SCALE!r} for FLA's Dk^-1/2, "
                                 f"got {self.scale!r}")
            object.__setattr__(self, "scale", float(self.scale))
        if not isinstance(self.output_gain, bool):
            raise ValueError(f"output_gain must be true or false, got {self.output_gain!r}")
        init = self.output_gain_init
        if not (isinstance(init, (int, float)) and not isinstance(init, bool) and 0 < init < math.inf):
            raise ValueError(f"output_gain_init must be a finite number > 0, got {init!r}")
        if init != 1.0 and not self.output_gain:
            raise ValueError(f"output_gain_init={init} sets the learned gains' start; it needs output_gain=true")
        object.__setattr__(self, "output_gain_init", float(init))
        self._check_liger_settings()
        keep = self.keep_full_attention
        if isinstance(keep, (list, tuple)):
            object.__setattr__(self, "keep_full_attention", tuple(int(i) for i in keep))
        elif isinstance(keep, float) and not 0.0 <= keep <= 1.0:
            raise ValueError(f"keep_full_attention as a fraction must be in [0, 1], got {keep}")
        elif not isinstance(keep, float):
            raise ValueError(f"keep_full_attention must be layer indices or a fraction, got {keep!r}")

    def _check_liger_settings(self):
        """The settings Liger-GLA's form needs: its feature map, q and k without RoPE, a state over every
        token, LoRA on some projections only."""
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"unknown feature_map {self.feature_map!r}; choose one of {list(FEATURE_MAPS)}")
        if self.feature_map != "l2" and self.mechanism != "gla":
            raise ValueError(f"feature_map={self.feature_map!r} is a GLA feature map (Liger-GLA's); use "
                             "mechanism='gla' or feature_map='l2'")
        for name in ("linear_rope", "state_covers_window"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        linear = self.mechanism not in ("softmax", "window")
        if (not self.linear_rope or self.state_covers_window) and not linear:
            raise ValueError(f"linear_rope and state_covers_window shape the linear part; mechanism="
                             f"{self.mechanism!r} has none")
        if not self.linear_rope and self.uses_shortconv:
            raise ValueError("linear_rope=false takes the linear part's q and k before RoPE, and the short conv "
                             "reads them after it; use adapter='lora' or none with it")
        if (not self.linear_rope or self.state_covers_window) and self.retain:
            raise ValueError(f"retain={self.retain} is for the paper's form; it does not combine with "
                             "linear_rope=false or state_covers_window=true")
        if self.state_covers_window and not self.window:
            raise ValueError("state_covers_window=true puts the window's tokens in the linear state too; it needs "
                             "window ≥ 1 (without a window the state holds every token already)")
        targets = self.lora_targets
        if not isinstance(targets, (list, tuple)) or not targets or any(t not in LORA_TARGETS for t in targets) \
                or len(set(targets)) != len(targets):
            raise ValueError(f"lora_targets must be a list of distinct projections from {list(LORA_TARGETS)}, got "
                             f"{targets!r}")
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in targets))
        if self.lora_targets != LORA_TARGETS and not self.uses_lora:
            raise ValueError(f"lora_targets={list(self.lora_targets)} chooses what LoRA adapts; it needs "
                             "adapter='lora' or 'shortconv+lora'")

    @property
    def uses_shortconv(self) -> bool:
        return "shortconv" in adapter_parts(self.adapter)

    @property
    def uses_lora(self) -> bool:
        return "lora" in adapter_parts(self.adapter)

    def uses_pallas(self) -> bool:
        """Whether the mixers run the Pallas kernels ("auto" resolved for this process's devices)."""
        return resolve_kernel(self.kernel) == "pallas"

    def full_attention_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layer indices kept as softmax attention."""
        keep = self.keep_full_attention
        if isinstance(keep, float):
            count = round(keep * num_layers)
            # The centres of `count` equal slices of the depth.
            return tuple(sorted({int((i + 0.5) * num_layers / count) for i in range(count)})) if count else ()
        bad = [i for i in keep if not -num_layers <= i < num_layers]
        if bad:
            raise ValueError(f"keep_full_attention has layer indices {bad} out of range for a "
                             f"{num_layers}-layer model (valid: 0..{num_layers - 1})")
        return tuple(sorted({i % num_layers for i in keep}))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if isinstance(out["keep_full_attention"], tuple):
            out["keep_full_attention"] = list(out["keep_full_attention"])
        out["lora_targets"] = list(out["lora_targets"])
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> LinearizeConfig:
        """From settings a user wrote (a TOML section): a missing setting takes today's default."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown linearize settings {unknown}; known: {sorted(known)}")
        return cls(**fields)

    @classmethod
    def from_saved(cls, fields: dict) -> LinearizeConfig:
        """From settings linjax saved (a checkpoint's manifest): a missing setting takes the default it
        had when the checkpoint was written, so old checkpoints load as they were trained."""
        return cls.from_dict({**LEGACY_DEFAULTS, **fields})


def linearize(model, config: LinearizeConfig, seed: int = 0):
    """A linearized copy of `model`: same (shared) pretrained arrays, new mixers with fresh parameters."""
    if getattr(model, "linearize_config", None) is not None:
        raise ValueError("this model is already linearized; linearize the pretrained model instead")
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)  # new module objects over the same (immutable) arrays
    keep = set(config.full_attention_layers(len(new.layers)))
    mixer_class = MIXERS[config.mechanism]
    rngs = KeySequence(seed)
    for i, block in enumerate(new.layers):
        if i in keep or mixer_class is SoftmaxAttention:
            continue
        block.attn = mixer_class(block.attn.proj, config, rngs=rngs)
    new.linearize_config = config
    return new


def with_budget(model, *, sinks: int, window: int, retain: int | None = None, retain_score: str | None = None,
                retain_block: int | None = None):
    """The same linearized model (shared arrays, new module objects) with every linear mixer's
    `SinksWindow` replaced by one at the new budget: evaluating a model trained at one cache budget at another
    (e.g. trained with 8 + 56, read with 8 + 120 = 128 cached tokens, or 8 + 56 + `retain` 64 retained
    tokens; None keeps the model's `retain`, `retain_score` and `retain_block`). No parameter changes."""
    config = getattr(model, "linearize_config", None)
    if config is None:
        raise ValueError("with_budget needs a linearized model (a plain model has a full KV cache)")
    retain = config.retain if retain is None else retain
    retain_score = config.retain_score if retain_score is None else retain_score
    retain_block = (config.retain_block if retain else 1) if retain_block is None else retain_block
    config = dataclasses.replace(config, sinks=sinks, window=window, retain=retain, retain_score=retain_score,
                                 retain_block=retain_block)  # validates them
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)
    for block in new.layers:
        if not isinstance(block.attn, SoftmaxAttention):
            block.attn.sinks_window = block.attn.sinks_window.with_budget(
                sinks=sinks, window=window, retain=retain, retain_score=retain_score, retain_block=retain_block)
    new.linearize_config = config
    return new


class KeySequence:
    """Hands out `params()` keys like `nnx.Rngs`, as fold_in(key(seed), n) with a Python counter.

    nnx.Rngs keeps its counter in a Variable, and updating a Variable with a
    traced value under `nnx.eval_shape` is slow enough to make building an
    abstract linearized 8B model take seconds. Mixers only call `params()`.
    """

    def __init__(self, seed: int):
        self._key, self._count = jax.random.key(seed), 0

    def params(self):
        self._count += 1
        return jax.random.fold_in(self._key, self._count)


def mixer_names(model) -> list[str]:
    """The mechanism of each layer, e.g. ['gdn', 'softmax', 'gdn', ...]."""
    by_class = {cls: name for name, cls in MIXERS.items()}
    return [by_class[type(block.attn)] for block in model.layers]


def trainable_parameter_count(model) -> int:
    """Scalars in the parameters that linearization added (what training updates)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, Trainable)))

