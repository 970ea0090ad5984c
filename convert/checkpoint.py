"""linjax's own checkpoint format: a directory with `linjax.json`, orbax parameters and a tokenizer.

`linjax.json` records what is needed to rebuild the model's structure (the HF
config and the parameter dtype); the parameters are restored by orbax into an
abstract model built with `nnx.eval_shape`, so restoring allocates each array
once. Orbax writes into a temporary directory and renames it when complete, so
an interrupted save leaves no half-written checkpoint; `save_checkpoint` writes the whole directory
beside its place and swaps it in, so parameters and manifest are always replaced together.
"""

from __future__ import annotations

import contextlib
import glob
import os

import jax
import jax.numpy as jnp
from flax import nnx

from linjax import heartbeat, integrity
from linjax.config import ModelConfig
from linjax.files import read_json, recover_interrupted_swap, swap_in, verify_output, write_directory, write_json
from linjax.layers import Trainable
from linjax.linearize import LinearizeConfig, linearize
from linjax.model import CausalLM, abstract_model

MANIFEST = "linjax.json"
FORMAT_VERSION = 1


def _checkpointer():
    """orbax's StandardCheckpointer. orbax is imported on first use: it takes a few tenths of a second
    to import, which every `linjax` command would pay (and commands that save nothing need not)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def is_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def save_checkpoint(model: CausalLM, directory: str, tokenizer=None) -> str:
    """Writes the checkpoint whole into a directory beside `directory` and swaps it in
    (`files.write_directory`), so an interrupted or failed save leaves the earlier checkpoint as it was,
    never new parameters beside an old manifest. Refuses a directory linjax did not write as an output."""
    return write_directory(directory, lambda staging: write_checkpoint_files(model, staging, tokenizer))


def write_checkpoint_files(model: CausalLM, directory: str, tokenizer=None) -> None:
    """params/ (orbax), tokenizer/ and linjax.json into an existing directory."""
    checkpointer = _checkpointer()
    checkpointer.save(os.path.join(directory, "params"), nnx.state(model))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))
    linearized = model.linearize_config
    manifest = {"format_version": FORMAT_VERSION, "dtype": str(model.dtype),
                "model_config": model.config.to_hf(),
                "linearize": None if linearized is None else linearized.to_dict()}
    write_json(os.path.join(directory, MANIFEST), manifest)


def save_trained(model: CausalLM, directory: str, *, base_source: str, dtype: str, steps: int | None = None,
                 inputs: dict | None = None) -> str:
    """A finished training run: only the trained parameters, plus where the frozen base comes from.

    `linjax.load(directory)` loads `base_source`, linearizes it with the saved
    settings and puts the trained parameters in; the frozen weights are not
    written again (they are bit-identical to the base's). The manifest records the
    run's length (`steps`) and its base model's fingerprint (`inputs`, see
    linjax.fingerprint). `trainable/` is written whole beside its place and swapped in
    (`files.recover_interrupted_swap` puts an earlier one back after a kill inside the
    swap), then the manifest is written: a kill or a full disk at any point leaves the
    earlier parameters or the new ones, never none.
    """
    directory = os.path.abspath(directory)
    if os.path.exists(base_source):
        base_source = os.path.abspath(base_source)
    target = os.path.join(directory, "trainable")
    # The same name on every process of a multi-process save (orbax writes it together).
    staging = os.path.join(directory, ".trainable.linjax-new-save")
    if jax.process_index() == 0:
        recover_interrupted_swap(target)  # also removes a staging folder a killed save left
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("linjax save_trained: staging cleared")
    checkpointer = _checkpointer()  # every process takes part in a multi-process save
    with heartbeat.temporary(staging):
        checkpointer.save(staging, nnx.state(model, Trainable))
        checkpointer.wait_until_finished()
        if jax.process_index() != 0:
            return directory
        integrity.write_manifest(staging)  # last: the hashes travel with the parameters they describe
        swap_in(staging, target)
    manifest = {"format_version": FORMAT_VERSION, "kind": "trained", "base_source": base_source,
                "dtype": str(jnp.dtype(dtype)), "model_config": model.config.to_hf(),
                "linearize": model.linearize_config.to_dict(), "integrity": integrity.MANIFEST}
    if steps is not None:
        manifest["steps"] = steps
    if inputs is not None:
        manifest["inputs"] = inputs
    write_json(os.path.join(directory, MANIFEST), manifest)
    return directory


def _on_this_process(tree):
    """Restore targets on this process's first device: a checkpoint written by a multi-device or
    multi-process run carries its own shardings, which need not exist here."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def trained_model(base: CausalLM, directory: str, manifest: dict) -> CausalLM:
    """The model of a training run (`save_trained`): `base`, loaded from the manifest's `base_source`
    by the caller (`sources.load`), linearized as saved, with the trained parameters put in."""
    if base.config != ModelConfig.from_hf(manifest["model_config"]):
        raise ValueError(f"{directory}: the base model at {manifest['base_source']!r} has changed since training")
    model = linearize(base, LinearizeConfig.from_saved(manifest["linearize"]))
    _restore_trainable(model, directory)
    return model


def _restore_trainable(model: CausalLM, directory: str, without_lora: bool = False) -> None:
    """The run's parameters into `model`; `without_lora`: all but the LoRA updates, which the run
    did not have (a stage adding LoRA keeps their initial values)."""
    which = nnx.All(Trainable, nnx.Not(nnx.PathContains("lora"))) if without_lora else Trainable
    target = _on_this_process(nnx.state(model, which))
    path = trainable_path(directory)
    verify_trainable(directory, path)
    try:
        restored = _checkpointer().restore(path, target)
    except Exception as err:  # orbax raises a bare Exception for a file cut short
        raise integrity.Damaged(f"the trained parameters in {path} cannot be read ({_first_line(err)}): they are "
                                f"damaged; {TRAINABLE_ADVICE}", path) from None
    integrity.refuse_non_finite(restored, path, TRAINABLE_ADVICE)
    nnx.update(model, restored)


TRAINABLE_ADVICE = ("restore the run from a copy, or rebuild its parameters from its last checkpoint with "
                    "`linjax train CONFIG --resume`")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def trainable_path(directory: str) -> str:
    """Where a finished run keeps its parameters: trainable/, or after a save killed inside its swap
    the earlier parameters set aside (they match the run's manifest). Absolute: orbax takes no other."""
    path = os.path.join(os.path.abspath(directory), "trainable")
    if not os.path.exists(path):
        aside = glob.glob(os.path.join(os.path.abspath(directory), ".trainable.linjax-old-*"))
        path = max(aside, key=os.path.getmtime) if aside else path
    return path


def verify_trainable(directory: str, path: str | None = None) -> None:
    """Checks a finished run's parameters against the hashes saved with them (`integrity.Damaged`, one
    line naming the file); a run saved before linjax recorded them is not checked."""
    path = path or trainable_path(directory)
    if integrity.has_manifest(path):
        integrity.verify(path, f"the trained parameters of {directory}", TRAINABLE_ADVICE)
        return
    with contextlib.suppress(OSError, ValueError):
        if "integrity" in read_json(os.path.join(directory, MANIFEST)) and os.path.isdir(path):
            raise integrity.Damaged(f"the trained parameters of {directory}: {path} has lost its record of hashes "
                                    f"({integrity.MANIFEST}), so they cannot be trusted; {TRAINABLE_ADVICE}", path)


# The adapter of a stage that adds LoRA to an earlier stage's, by the earlier one's.
ADDING_LORA = {None: "lora", "shortconv": "shortconv+lora"}


def load_trained_parameters(model: CausalLM, directory: str, base: dict | None = None) -> None:
    """Put a finished training run's parameters into `model`, linearized the same way on the same
    base (a later stage starting from an earlier one), or with LoRA added to its adapter (the LoRA
    updates keep their zero start); a mismatch is a ValueError naming it. `base`:
    the fingerprint of `model`'s base (`linjax.fingerprint.model_fingerprint`), compared with the one
    the run recorded."""
    path = os.path.join(os.path.abspath(directory), MANIFEST)
    if not os.path.exists(path):
        raise ValueError(f"{directory} is not a finished training run (no {MANIFEST}); finish it first, or "
                         "point train.init_from at the run directory itself")
    manifest = read_json(path)
    if manifest.get("kind") != "trained":
        raise ValueError(f"{directory} holds a whole model, not a training run's parameters; train.init_from "
                         "takes a run directory written by `linjax train`")
    if model.config != ModelConfig.from_hf(manifest["model_config"]):
        raise ValueError(f"{directory} was trained on another base model than this run's")
    recorded = (manifest.get("inputs") or {}).get("model")
    if base is not None and recorded:  # the same architecture is not yet the same weights
        from linjax import fingerprint

        fingerprint.check({"model": recorded}, {"model": base}, directory, "starting from its parameters")
    theirs = LinearizeConfig.from_saved(manifest["linearize"]).to_dict()
    ours = model.linearize_config.to_dict()
    # Settings that add no parameters: the kernels, and retained tokens (any run can be read with them).
    free = ("kernel", "chunk", "retain", "retain_score")
    differing = sorted(k for k in ours if ours[k] != theirs.get(k) and k not in free)
    # A later stage may add LoRA (B starts at zero, so it starts where the earlier stage ended).
    adds_lora = (set(differing) - {"lora_rank", "lora_alpha"} == {"adapter"}  # the new LoRA's own size is free
                 and ADDING_LORA.get(theirs.get("adapter")) == ours["adapter"])
    if differing and not adds_lora:
        raise ValueError(f"{directory} was linearized with other settings ("
                         + ", ".join(f"{k}: {theirs.get(k)!r} there, {ours[k]!r} here" for k in differing)
                         + "); train.init_from needs the same [linearize] settings (or LoRA added: "
                         + "adapter \"lora\" after none, \"shortconv+lora\" after \"shortconv\")")
    _restore_trainable(model, directory, without_lora=adds_lora)


def read_manifest(directory: str) -> dict:
    """linjax.json of a checkpoint; a ValueError if another linjax version wrote it (or it is damaged)."""
    manifest = read_json(os.path.join(directory, MANIFEST))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: checkpoint format {manifest.get('format_version')} "
                         f"is not {FORMAT_VERSION}; it was written by another linjax version")
    return manifest


def load_checkpoint(directory: str, dtype=None):
    """(model, tokenizer or None) from a directory written by `save_checkpoint`. A training run's
    directory (`save_trained`) holds only the trained parameters: `linjax.load` reads it."""
    directory = os.path.abspath(directory)
    verify_output(directory)  # every file against the hashes recorded when it was written
    manifest = read_manifest(directory)
    if manifest.get("kind") == "trained":
        raise ValueError(f"{directory} holds a training run's parameters on {manifest['base_source']!r}, "
                         "not a whole model; load it with linjax.load")
    config = ModelConfig.from_hf(manifest["model_config"])
    saved_dtype = jnp.dtype(manifest["dtype"])
    linearized = manifest.get("linearize")
    linearized = None if linearized is None else LinearizeConfig.from_saved(linearized)
    graphdef, abstract_state = nnx.split(abstract_model(config, linearized, dtype=saved_dtype))
    try:
        state = _checkpointer().restore(os.path.join(directory, "params"), _on_this_process(abstract_state))
    except Exception as err:  # orbax raises a bare Exception for a file cut short
        params = os.path.join(directory, "params")
        raise integrity.Damaged(f"the parameters in {params} cannot be read ({_first_line(err)}): they are "
                                "damaged; write the checkpoint again", directory) from None
    model = nnx.merge(graphdef, state)
    if dtype is not None and jnp.dtype(dtype) != saved_dtype:
        model = cast_model(model, dtype)
    tokenizer = None
    if os.path.isdir(os.path.join(directory, "tokenizer")):
        from transformers import AutoTokenizer  # on use only: it takes half a second to import

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
    return model, tokenizer


def cast_model(model: CausalLM, dtype) -> CausalLM:
    """The same model with the pretrained parameters and compute in `dtype`.

    New (trainable) parameters stay fp32, as they are created: they are few,
    and their optimizer updates need the precision.
    """
    dtype = jnp.dtype(dtype)
    graphdef, state = nnx.split(abstract_model(model.config, model.linearize_config, dtype=dtype))
    values = nnx.to_pure_dict(nnx.state(model))
    targets = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a, t: jnp.asarray(a, t.dtype), values, targets))
    return nnx.merge(graphdef, state)
