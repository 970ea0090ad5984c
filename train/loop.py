"""`run(config)`: train the new parameters of a linearized model, the paper's way.

Only parameters of type `Trainable` (what linearization added) get gradients
and optimizer state; the pretrained weights are a separate, frozen input to
the jitted step and stay bit-identical. AdamW with a linear warm-up and cosine
decay, gradient clipping at 1 (paper, appendix).

A run directory holds `config.json` (the experiment the run was started with,
and a `history` of its starts and resumptions), `metrics.jsonl` (one JSON object
per step), `checkpoints/<step>/` (orbax: trainable parameters, optimizer state
and the data position, saved together), and, once finished, `linjax.json` +
`trainable/` so that `linjax.load(run_dir)` returns the trained model. The
steps use no randomness (no dropout; the data order derives from the seed),
so a resumed run repeats an uninterrupted one exactly. A resumption with
settings that change the experiment (anything but `train.steps` and the
settings in `config.OPERATIONAL`) is refused, so one run directory never
records two experiments. A kill at any moment, a checkpoint save included,
loses only the steps since the last completed checkpoint: orbax writes each
checkpoint to a temporary directory and renames it when complete, and a
resumed run drops the metrics logged after that checkpoint.

A run directory belongs to one run, written by one process at a time (a lock
beside it, `linjax.files.writer_lock`). A start at step 0 where a run already
left anything (`RUN_HISTORY`) is refused; `resume=True` on a finished run
changes nothing, and with a larger `train.steps` continues it from its last
checkpoint. The run records fingerprints of its base model, tokenizer and data
(`linjax.fingerprint`) and refuses to resume on changed ones. SIGTERM or SIGINT
stops it at the next step boundary with a checkpoint of that step saved
(`Stopped`; `linjax train` then exits with 128 + the signal's number).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import linjax
from linjax import fingerprint, heartbeat, integrity
from linjax.convert.checkpoint import MANIFEST, load_trained_parameters, save_trained, verify_trainable
from linjax.experiment import OPERATIONAL, describe_changes, setting_changes
from linjax.files import read_json, recover_interrupted_swap, refuse_overlap, write_json, write_text, writer_lock
from linjax.layers import Trainable
from linjax.platform import device_description
from linjax.scan import layer_runs, per_layer, stack_layers, stacked_by_run, unstack_layers
from linjax.train import schedules, sharding
from linjax.train.data import build_dataset
from linjax.train.objectives import objective_loss
from linjax.train.validation import Validation


class TrainingDiverged(ValueError):
    """A step gave a non-finite loss or gradient: training stops before logging or saving that step."""

    def __init__(self, step: int, metrics: dict, last_checkpoint: int | None):
        values = ", ".join(f"{name} {value:.4g}" for name, value in metrics.items())
        kept = (f"the last checkpoint (step {last_checkpoint}) is intact" if last_checkpoint is not None
                else "no checkpoint was saved before it")
        super().__init__(f"training diverged at step {step} ({values}); nothing of that step was saved and {kept}. "
                         "Lower train.lr or raise train.warmup_steps, in a new run_dir")


def make_optimizer(train_config, adapter):
    """(optimizer, schedule): AdamW with `train.schedule`'s learning rate (train/schedules.py)."""
    return schedules.make_optimizer(train_config, train_config.learning_rate(adapter))


# The attributes of a linear mixer that hold its adapter (linjax/mixers/linear.py: LoRA, short conv).
ADAPTER_ATTRIBUTES = ("lora", "conv")


def is_adapter_parameter(path) -> bool:
    """Whether a trainable parameter's key path (jax.tree_util) lies in a mixer's adapter."""
    return any(getattr(key, "key", None) in ADAPTER_ATTRIBUTES for key in path)


def trained_parameters(trainable, which: str):
    """A tree of Python bools shaped like `trainable`: the parameters `train.trainable` = `which`
    trains ("all", "mechanism": all but the adapter's, "adapter": the adapter's only). A ValueError
    if it selects none."""
    selected = jax.tree_util.tree_map_with_path(
        lambda path, _: which == "all" or (which == "adapter") == is_adapter_parameter(path), trainable)
    if not any(jax.tree.leaves(selected)):
        raise ValueError(f"train.trainable = {which!r} selects none of the new parameters (the mechanism adds "
                         "none of its own: its only new parameters are the adapter's); use \"all\" or \"adapter\"")
    return selected


# XLA:GPU otherwise compiles many matmul fusions as Triton kernels of their own (and, on a card, autotunes
# each one): a quarter of the final recipe's compile time for an H100 (results/bench/compile-gpu-*/);
# cuBLAS runs those matmuls instead. Other platforms ignore the option.
GPU_COMPILE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def make_train_step(graphdef, optimizer, objective: str, mesh, *, remat: str | None = None,
                    loss_chunk: int | None = None, trains=None):
    """A jitted (trainable, opt_state, frozen, batch) → (trainable, opt_state, metrics) step.

    `remat`: what the backward recomputes of each layer (`CausalLM.remat`: None, "dots" or "full";
    `TrainSection.remat_policy`); `loss_chunk`: positions per piece of the LM head and the loss
    (`objectives.lm_loss`; None: all at once). `trains` (`trained_parameters`; None: all): the
    other parameters' gradients are zeroed before the clipping (the norm counts only what trains)
    and their updates after the optimizer (so weight decay leaves them alone too): they keep their
    values exactly.

    `trainable` and `frozen` are held stacked by layer run (`linjax.scan.StackedLayers`, see
    `place_train_state`); `opt_state` is the optimizer's state for the stacked `trainable`.

    Outputs are pinned to the replicated sharding the inputs have, so the step
    compiles once instead of again after its first call.
    """

    def held_at_zero(tree):
        if trains is None:
            return tree
        return jax.tree.map(lambda x, trained: x if trained else jnp.zeros_like(x), tree, trains)

    def step(trainable, opt_state, frozen, batch):
        def loss_fn(params):
            model = nnx.merge(graphdef, unstack_layers(params), unstack_layers(frozen))
            model.remat = remat
            return objective_loss(model, batch, objective, loss_chunk=loss_chunk)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        grads = held_at_zero(grads)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        updates = held_at_zero(updates)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}

    replicated = sharding.replicated_sharding(mesh)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(replicated, replicated, replicated),
                   compiler_options=GPU_COMPILE_OPTIONS)


def place_train_state(model, optimizer, mesh):
    """(graphdef, trainable, opt_state, frozen, runs) as the training step takes them.

    Both parameter parts are stacked by layer run (`StackedLayers`); the frozen weights are
    sharded over the mesh's fsdp axis, the trainable ones and the optimizer state replicated.
    `runs` converts to and from the per-layer form that checkpoints keep
    (`linjax.scan.per_layer` / `stacked_by_run`).
    """
    runs = layer_runs(model.layers)
    graphdef, trainable, frozen = nnx.split(model, Trainable, ...)
    if not jax.tree.leaves(trainable):
        settings = model.linearize_config.to_dict() if model.linearize_config is not None else None
        raise ValueError(f"linearize settings {settings} add no trainable parameters "
                         "(e.g. mechanism 'window' or 'softmax'): there is nothing to train; evaluate the "
                         "experiment file directly (linjax eval ... CONFIG.toml)")
    trainable = sharding.replicate(stack_layers(trainable, runs), mesh)
    # Sharded before stacking, so that the stacking runs spread over the mesh: stacking first
    # would put a whole copy of the frozen model on one device.
    frozen = sharding.shard_frozen(stack_layers(sharding.shard_frozen(frozen, mesh), runs), mesh)
    opt_state = sharding.replicate(optimizer.init(trainable), mesh)
    return graphdef, trainable, opt_state, frozen, runs


def abstract_train_state(model, optimizer, mesh):
    """`place_train_state`'s (graphdef, trainable, opt_state, frozen) as ShapeDtypeStructs carrying the
    shardings it would give on `mesh`, for a model whose arrays may be abstract (`nnx.eval_shape`): the
    training step then lowers and compiles for `mesh`'s devices without a weight in memory (an 8B model
    compiled for a GPU on a CPU machine: bench/compile_gpu.py)."""
    runs = layer_runs(model.layers)
    graphdef, trainable, frozen = nnx.split(model, Trainable, ...)
    stacked = lambda state: jax.eval_shape(lambda s: stack_layers(s, runs), state)  # noqa: E731
    trainable, frozen = stacked(trainable), stacked(frozen)
    opt_state = jax.eval_shape(optimizer.init, trainable)
    placed = lambda tree, shardings: jax.tree.map(  # noqa: E731
        lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree, shardings)
    everywhere = lambda tree: jax.tree.map(lambda _: sharding.replicated_sharding(mesh), tree)  # noqa: E731
    return (graphdef, placed(trainable, everywhere(trainable)), placed(opt_state, everywhere(opt_state)),
            placed(frozen, sharding.frozen_shardings(frozen, mesh)))


def _truncate_metrics(path: str, last_step: int):
    """Drop metrics logged after the checkpoint a run (re)starts from (all of them when it starts
    from step 0), and a last line that a kill cut short."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["step"] <= last_step:
                kept.append(json.dumps(record) + "\n")
    write_text(path, "".join(kept))


# What a run leaves in its directory: any of them there means a run was started in it.
RUN_HISTORY = ("config.json", "metrics.jsonl", "checkpoints", "trainable", MANIFEST)


def run_history(run_dir: str) -> list[str]:
    """The entries of `RUN_HISTORY` that `run_dir` holds (an empty checkpoints/ folder does not count)."""
    found = []
    for name in RUN_HISTORY:
        path = os.path.join(run_dir, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def finished_steps(run_dir: str) -> int | None:
    """How many steps a finished run (`save_trained`'s manifest and parameters) trained; None if it has
    not finished. Runs saved before the manifest recorded it: the last step of metrics.jsonl."""
    try:
        with open(os.path.join(run_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("kind") != "trained" or not os.path.isdir(os.path.join(run_dir, "trainable")):
        return None
    if "steps" in manifest:
        return int(manifest["steps"])
    with contextlib.suppress(OSError, ValueError, KeyError), open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.strip())
    return None


def _stored_record(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return None
    return read_json(path)


def _refuse_other_settings(stored: dict, record: dict, run_dir: str) -> None:
    stored = {k: v for k, v in stored.items() if k not in ("history", "inputs")}
    changes = setting_changes(stored, record, ignore=OPERATIONAL)
    if changes:
        raise ValueError(f"{run_dir} was started with other settings: {describe_changes(changes)}; resuming would "
                         "mix two experiments in one run. Resume with the original settings, or train the new "
                         "ones in a new run_dir (only train.steps, checkpoint_every, keep_checkpoints, mesh_*, remat, "
                         "loss_chunk, linearize.kernel/chunk and [eval] may change on --resume)")


def _run_record(config, run_dir: str, step: int, inputs: dict) -> dict:
    """config.json for a run (re)starting at `step`: the experiment, its inputs' fingerprints, and its
    history of starts and resumptions, each naming the devices it ran on. A resumption whose settings
    change the experiment, or whose inputs changed (unless allowed), is refused (ValueError)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record = config.to_dict()
    stored = _stored_record(run_dir)
    if step == 0 or stored is None:  # nothing trained yet: a fresh start
        return {**record, "inputs": inputs,
                "history": [{"event": "start", "time": now, "steps": config.train.steps,
                             "device": device_description()}]}
    history = stored.pop("history", [])
    _refuse_other_settings(stored, record, run_dir)
    changed_inputs = fingerprint.check(stored.pop("inputs", None), inputs, run_dir, "resuming it")
    if config.train.steps < step:
        raise ValueError(f"train.steps={config.train.steps} is below the step of the last checkpoint in {run_dir} "
                         f"({step}); resume with train.steps ≥ {step}")
    entry = {"event": "resume", "time": now, "at_step": step, "device": device_description()}
    changed = setting_changes(stored, record, ignore=("eval",))  # operational changes, recorded
    if changed:
        entry["changed"] = {k: list(v) for k, v in changed.items()}
    if changed_inputs:
        entry["inputs_changed"] = changed_inputs
    return {**record, "inputs": inputs, "history": history + [entry]}


def _has_checkpoint(run_dir: str) -> bool:
    folder = os.path.join(run_dir, "checkpoints")  # orbax names a step's folder by its number once committed
    return os.path.isdir(folder) and any(n.isdigit() for n in os.listdir(folder))


def _finished_as_asked(config, run_dir: str, finished: int) -> bool:
    """Whether a finished run is already what `config` asks for (then nothing is written, not even an
    empty checkpoints/ folder, and its inputs are not needed: loading it checks its base model); a
    ValueError if it cannot become that by training on (other settings, fewer steps, or more steps
    with no checkpoint left to continue from)."""
    _refuse_other_settings(_stored_record(run_dir) or {}, config.to_dict(), run_dir)
    steps = config.train.steps
    if steps < finished:
        raise ValueError(f"train.steps={steps} is below the {finished} steps {run_dir} finished; resume with "
                         f"train.steps ≥ {finished}")
    if steps == finished:
        if jax.process_index() == 0:
            print(f"{run_dir} is finished ({finished} steps); nothing to do (raise train.steps to extend it)",
                  flush=True)
        return True
    if not _has_checkpoint(run_dir):
        raise ValueError(f"{run_dir} finished at {finished} steps and keeps no checkpoint to continue from (its "
                         f"checkpoints/ were removed), so it cannot be extended to {steps}; train the longer run "
                         "in a new run_dir")
    return False


class Stopped(Exception):
    """Training stopped on a signal at a step boundary, its checkpoint saved (or, `finished`, during the
    final save, which was completed first)."""

    def __init__(self, signum: int, step: int, run_dir: str, finished: bool = False):
        self.signum, self.step = signum, step
        name = signal.Signals(signum).name
        if finished:
            super().__init__(f"stopped by {name} during the final save, which was completed first: {run_dir} is "
                             f"finished ({step} steps)")
        else:
            super().__init__(f"stopped by {name} at step {step}; its checkpoint is saved in {run_dir}: continue "
                             "with --resume")


class _StopRequests:
    """SIGTERM (a preemption, a scheduler's time limit) and SIGINT (Ctrl-C) while training ask it to stop
    at the next step boundary instead of at once. A second signal acts as usual (ends the process)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        for s, handler in self.previous.items():  # the next one is not caught
            signal.signal(s, handler)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def requested(self) -> int | None:
        """The signal that asked to stop, agreed by every process (they must stop at the same step)."""
        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        signum = int(np.max(multihost_utils.process_allgather(np.int32(self.signum or 0))))
        return signum or None


def _plain_lines(run_dir: str, enabled: bool):
    """`say(text)`: what a log without a progress bar (`--no-progress`) shows of a run, on stdout as it
    happens: the model ready, the first step (mostly compilation) and each checkpoint, so that a run
    that seems stuck shows whether it is loading, compiling or stepping. (stderr keeps errors alone:
    one line each.)"""
    name = os.path.basename(run_dir)

    def say(text: str) -> None:
        if enabled:
            print(f"{name}: {text}", flush=True)

    return say


def run(config, resume: bool = False, progress: bool = True, allow_changed_inputs: bool = False,
        load_finished: bool = True):
    """Trains as `config` (an ExperimentConfig) says; returns the trained model. `resume`: continue the
    run in `config.run_dir` (a finished one is loaded and returned as it is, or with `load_finished`
    False, None); `allow_changed_inputs`: resume although the base model, tokenizer or data changed
    since the run recorded them."""
    run_dir = os.path.abspath(config.run_dir)
    refuse_overlap_with_inputs(run_dir, config)  # before anything is written
    with fingerprint.changes_allowed(allow_changed_inputs):
        # A finished run that is what the config asks for needs no writing, so no lock: it answers on a
        # read-only file system too.
        if resume and _finished_without_writing(config, run_dir):
            return linjax.load(run_dir, dtype=config.model.dtype)[0] if load_finished else None
        os.makedirs(run_dir, exist_ok=True)
        # Process 0 speaks for a multi-process run (the others write only their part of each checkpoint).
        lock = writer_lock(run_dir, f"the run {run_dir}") if jax.process_index() == 0 else contextlib.nullcontext()
        with lock:
            return _run(config, run_dir, resume, progress, load_finished)


def refuse_overlap_with_inputs(run_dir: str, config) -> None:
    """A run directory lies apart from what the run reads (inside the training data folder, its config.json
    would be read as training text), and is not the run it starts from (`train.init_from`)."""
    from linjax.convert.sources import local_path

    inputs = [("the base model", local_path(config.model.source))]
    inputs += [("the training data", path) for path in config.data.paths or ()]
    refuse_overlap(run_dir, inputs, "the run directory", "a run_dir")
    refuse_overlap(run_dir, [("the run it starts from (train.init_from)", config.train.init_from)],
                   "the run directory", "another run_dir", relations=("is",))


def _finished_without_writing(config, run_dir: str) -> bool:
    """Whether `run_dir` holds a finished run, intact, that `config` asks for as it is (read only)."""
    finished = finished_steps(run_dir)
    if finished is None or _damaged_trainable(run_dir) is not None:
        return False
    stored = _stored_record(run_dir)
    if stored is not None:
        _refuse_other_settings(stored, config.to_dict(), run_dir)
    return _finished_as_asked(config, run_dir, finished)


def _damaged_trainable(run_dir: str) -> integrity.Damaged | None:
    try:
        verify_trainable(run_dir)
    except integrity.Damaged as damage:
        return damage
    return None


DAMAGED_CHECKPOINTS = "damaged-checkpoints"


def _set_aside_damaged_checkpoints(checkpoint_dir: str, run_dir: str) -> None:
    """Moves the newest checkpoints that fail their hashes, or lack them (a kill came between orbax's commit
    and the record, which is written last), to RUN/damaged-checkpoints/, naming each on stderr, so that the
    run resumes from the newest intact one. A run whose checkpoints have no records (saved before linjax
    kept them) is left as it is."""
    if not os.path.isdir(checkpoint_dir):
        return
    steps = sorted((int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()), reverse=True)
    if not any(integrity.has_manifest(os.path.join(checkpoint_dir, str(step))) for step in steps):
        return
    set_aside = []
    for step in steps:
        path = os.path.join(checkpoint_dir, str(step))
        try:
            if not integrity.has_manifest(path):
                raise integrity.Damaged(f"{path} has no {integrity.MANIFEST} (its save was interrupted)", path)
            integrity.verify(path, f"checkpoint {step}", "")
            break
        except integrity.Damaged as damage:
            folder = os.path.join(run_dir, DAMAGED_CHECKPOINTS)
            os.makedirs(folder, exist_ok=True)
            aside = os.path.join(folder, str(step))
            while os.path.exists(aside):
                aside += "+"
            os.rename(path, aside)
            set_aside.append(step)
            print(f"linjax: {damage}; set aside in {aside}", file=sys.stderr, flush=True)
    if set_aside:
        remaining = [s for s in steps if s not in set_aside]
        where = f"checkpoint {remaining[0]}, the newest intact one" if remaining else "step 0 (no intact checkpoint)"
        print(f"linjax: resuming {run_dir} from {where}", file=sys.stderr, flush=True)


def _run(config, run_dir: str, resume: bool, progress: bool, load_finished: bool):
    import orbax.checkpoint as ocp  # on use only: a few tenths of a second that every `linjax` command would pay

    tc = config.train
    checkpoint_dir = os.path.join(run_dir, "checkpoints")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if jax.process_index() == 0:
        recover_interrupted_swap(os.path.join(run_dir, "trainable"))  # a save_trained killed in its swap
    history, finished = run_history(run_dir), finished_steps(run_dir)
    damage = _damaged_trainable(run_dir) if finished is not None else None
    if damage is not None:
        if not (resume and _has_checkpoint(run_dir)):
            raise damage
        print(f"linjax: {run_dir}/trainable is damaged ({damage.path}); rebuilding it from the run's checkpoints",
              file=sys.stderr, flush=True)
        finished = None  # resumed from its last checkpoint, it is saved again
    if history and not resume:
        what = f"a finished run ({finished} steps)" if finished is not None else f"a run ({', '.join(history)})"
        raise FileExistsError(f"{run_dir} already holds {what}; starting again would overwrite it. Continue it "
                              "with --resume (a finished run: raise train.steps to extend it), or choose another "
                              "run_dir")
    stored = _stored_record(run_dir)
    if resume and stored is not None and (finished is not None or _has_checkpoint(run_dir)):
        _refuse_other_settings(stored, config.to_dict(), run_dir)  # first: it names the setting a user changed
    if finished is not None and _finished_as_asked(config, run_dir, finished):
        return linjax.load(run_dir, dtype=config.model.dtype)[0] if load_finished else None
    inputs = fingerprint.run_inputs(config)  # before anything is written: a missing data file stops here
    if resume and jax.process_index() == 0:
        _set_aside_damaged_checkpoints(checkpoint_dir, run_dir)
    if resume and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("linjax resume: damaged checkpoints set aside")
    # A save killed halfway leaves only a temporary directory, which orbax never lists as a step;
    # cleanup_tmp_directories removes it at the next start.
    manager = ocp.CheckpointManager(checkpoint_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=tc.keep_checkpoints, create=True, enable_async_checkpointing=False,
        cleanup_tmp_directories=True))
    start_step = manager.latest_step() if resume and manager.latest_step() is not None else 0
    try:
        record = _run_record(config, run_dir, start_step, inputs)
    except ValueError:
        manager.close()
        raise
    if jax.process_index() == 0:
        write_json(os.path.join(run_dir, "config.json"), record)

    began = time.perf_counter()
    say = _plain_lines(run_dir, enabled=not progress and jax.process_index() == 0)
    model, tokenizer = linjax.load(config.model.source, dtype=config.model.dtype)
    if tokenizer is None:
        raise ValueError(f"{config.model.source} has no tokenizer; training needs one to read text")
    model = linjax.linearize(model, config.linearize, seed=tc.seed)
    if tc.init_from and not start_step:  # on resume the checkpoint holds the parameters
        load_trained_parameters(model, tc.init_from, base=inputs["model"])
    mesh = sharding.make_mesh(tc.mesh_data, tc.mesh_fsdp)
    optimizer, schedule = make_optimizer(tc, config.linearize.adapter)
    graphdef, trainable, opt_state, frozen, runs = place_train_state(model, optimizer, mesh)
    trains = None if tc.trainable == "all" else trained_parameters(trainable, tc.trainable)
    parameters = linjax.trainable_parameter_count(model)
    del model  # frees the per-layer weights, which the stacked copies replace
    dataset = build_dataset(config.data, tokenizer, seq_len=tc.seq_len, batch_size=tc.batch_size, seed=tc.seed)

    step = start_step
    if step:
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                train_state=ocp.args.StandardRestore(per_layer({"trainable": trainable, "opt_state": opt_state})),
                data=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises a bare Exception for a file cut short, tensorstore a ValueError
            manager.close()
            raise integrity.Damaged(f"checkpoint {step} of {run_dir} cannot be read ({_first_line(err)}): it is "
                                    f"damaged; move {os.path.join(checkpoint_dir, str(step))} out of checkpoints/ "
                                    "and --resume again to go on from the one before", checkpoint_dir) from None
        integrity.refuse_non_finite(restored["train_state"], os.path.join(checkpoint_dir, str(step)),
                                    "the checkpoint is damaged; move it out of checkpoints/ and --resume again")
        restored_state = sharding.replicate(stacked_by_run(restored["train_state"], runs), mesh)
        trainable, opt_state = restored_state["trainable"], restored_state["opt_state"]
        dataset.restore(restored["data"])
    if jax.process_index() == 0:
        _truncate_metrics(metrics_path, step)

    def save(at_step):
        manager.save(at_step, args=ocp.args.Composite(
            train_state=ocp.args.StandardSave(per_layer({"trainable": trainable, "opt_state": opt_state})),
            data=ocp.args.JsonSave(dataset.state())), force=True)
        manager.wait_until_finished()
        if jax.process_index() == 0:  # last: a checkpoint without it is one a kill interrupted
            integrity.write_manifest(os.path.join(checkpoint_dir, str(at_step)))

    train_step = make_train_step(graphdef, optimizer, tc.objective, mesh, remat=tc.remat_policy(),
                                 loss_chunk=tc.loss_chunk_size(), trains=trains)
    validation = Validation.create(config, tokenizer, graphdef, frozen, runs, mesh, run_dir, schedule, opt_state)
    tokens_per_step = tc.batch_size * tc.seq_len
    say(f"model loaded and linearized ({parameters:,} new parameters) in {time.perf_counter() - began:.0f} s; "
        f"step {step + 1} of {tc.steps} next, compiled first")
    try:
        bar = tqdm(total=tc.steps, initial=step, desc="train", disable=not progress or jax.process_index() != 0,
                   dynamic_ncols=True)
        with open(metrics_path, "a") as log, _StopRequests() as stop:
            while step < tc.steps:
                signum = stop.requested()
                if signum:
                    if manager.latest_step() != step:
                        save(step)
                    bar.close()
                    raise Stopped(signum, step, run_dir)
                start = time.perf_counter()
                batch = sharding.put_batch(dataset.next_batch(), mesh)
                lr = float(schedule(step))
                trainable, opt_state, metrics = train_step(trainable, opt_state, frozen, batch)
                metrics = {k: float(v) for k, v in metrics.items()}
                elapsed = time.perf_counter() - start
                step += 1
                if not all(map(jnp.isfinite, metrics.values())):  # checked before anything of this step is kept
                    raise TrainingDiverged(step, metrics, manager.latest_step())
                record = {"step": step, **metrics, "lr": lr, "tokens_per_s": tokens_per_step / elapsed}
                if jax.process_index() == 0:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
                heartbeat.progress()
                if validation is not None:  # before the step's checkpoint, which holds the plateau's state
                    opt_state = validation.after_step(step, trainable, opt_state)
                if step == start_step + 1:
                    say(f"step {step} took {elapsed:.1f} s (its compilation included), loss {metrics['loss']:.4f}")
                if step % tc.checkpoint_every == 0 or step == tc.steps:
                    save(step)
                    say(f"step {step} of {tc.steps}: loss {metrics['loss']:.4f}, "
                        f"{record['tokens_per_s']:,.0f} tokens/s; checkpoint saved")
        bar.close()
    finally:
        manager.close()  # stops orbax's background threads (many runs may share a process)
    if validation is not None:  # the best validation's parameters, with train.keep = "best_validation"
        trainable = validation.kept(trainable)
    with _StopRequests() as stop:  # a signal now waits for the final save to complete
        model = nnx.merge(graphdef, unstack_layers(trainable), unstack_layers(frozen))
        save_trained(model, run_dir, base_source=config.model.source, dtype=config.model.dtype, steps=tc.steps,
                     inputs={"model": inputs["model"]})
    if stop.signum:
        raise Stopped(stop.signum, tc.steps, run_dir, finished=True)
    return model


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
