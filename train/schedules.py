"""The optimizer of `linjax train` and its learning-rate schedule (`train.schedule`).

"cosine" (the paper's): AdamW, a linear warm-up over `warmup_steps`, then cosine decay to 0 at `steps`.

"plateau" (Liger's, after PyTorch's ReduceLROnPlateau as its trainer sets it): AdamW at the rate reached
after the warm-up (none in Liger), cut by `PLATEAU_FACTOR` whenever the validation loss (train.validation,
train/validation.py) has not improved on its best by a relative `PLATEAU_THRESHOLD` for more than
`PLATEAU_PATIENCE` validations in a row, never below `PLATEAU_MIN_LR`. The cut is a factor on the
updates, AdamW's weight decay included (as lowering the rate is in PyTorch), held in the optimizer's
state (`PlateauState`), so a checkpoint carries it and a resumed run goes on with it.

Both clip the gradients' global norm at `grad_clip` first (0: no clipping, as Liger's trainer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from linjax.experiment import SCHEDULES  # noqa: F401  (train.schedule's choices, checked there)

# torch.optim.lr_scheduler.ReduceLROnPlateau(mode="min", factor=0.1, patience=10, min_lr=1e-5) as Liger's
# training/utils.py builds it; threshold 1e-4 relative is PyTorch's default.
PLATEAU_FACTOR, PLATEAU_PATIENCE, PLATEAU_MIN_LR, PLATEAU_THRESHOLD = 0.1, 10, 1e-5, 1e-4


class PlateauState(NamedTuple):
    """The plateau schedule's state: the factor on the updates, the best validation loss so far and how many
    validations in a row have not improved on it."""

    scale: jax.Array
    best: jax.Array
    bad: jax.Array


def scale_by_plateau() -> optax.GradientTransformation:
    """Multiplies the updates by `PlateauState.scale` (1 at the start); `plateau_step` changes it."""

    def init(params):
        del params
        return PlateauState(jnp.ones((), jnp.float32), jnp.full((), jnp.inf, jnp.float32), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u * state.scale.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def is_plateau_state(x) -> bool:
    return isinstance(x, PlateauState)


def plateau_state(opt_state) -> PlateauState | None:
    """The optimizer state's PlateauState, or None (another schedule)."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_plateau_state) if is_plateau_state(x)]
    return found[0] if found else None


def plateau_step(opt_state, loss: float, peak_lr: float):
    """The optimizer state after a validation loss `loss`, as ReduceLROnPlateau.step(loss) changes the rate:
    a new best (below best · (1 − threshold)) resets the count; otherwise the count grows, and past the
    patience the scale is cut by the factor (not below min_lr / peak_lr) and the count restarts."""
    def step(state):
        if not is_plateau_state(state):
            return state
        scale, best, bad = float(state.scale), float(state.best), int(state.bad)
        if loss < best * (1 - PLATEAU_THRESHOLD):
            best, bad = loss, 0
        else:
            bad += 1
        if bad > PLATEAU_PATIENCE:
            floor = PLATEAU_MIN_LR / peak_lr if peak_lr > 0 else 0.0
            cut = max(scale * PLATEAU_FACTOR, floor)
            if scale - cut > 1e-8 / max(peak_lr, 1e-30):  # PyTorch's eps: a cut too small to matter is skipped
                scale = cut
            bad = 0
        return PlateauState(jnp.asarray(scale, state.scale.dtype), jnp.asarray(best, state.best.dtype),
                            jnp.asarray(bad, state.bad.dtype))

    return jax.tree.map(step, opt_state, is_leaf=is_plateau_state)


class Schedule:
    """The learning rate at a step, as the training loop logs it: the schedule's, times the plateau's
    current scale (`set_scale`; 1 for the cosine schedule)."""

    def __init__(self, base):
        self.base, self.scale = base, 1.0

    def __call__(self, step):
        return self.base(step) * self.scale

    def set_scale(self, opt_state):
        state = plateau_state(opt_state)
        self.scale = 1.0 if state is None else float(state.scale)


def make_optimizer(train_config, lr: float):
    """(the optax optimizer, its `Schedule`) for `train_config` (a TrainSection) at peak rate `lr`."""
    tc = train_config
    if tc.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=tc.warmup_steps,
                                                  decay_steps=tc.steps, end_value=0.0)
    elif tc.schedule == "plateau":
        base = (optax.linear_schedule(0.0, lr, tc.warmup_steps) if tc.warmup_steps else optax.constant_schedule(lr))
    else:
        raise ValueError(f"unknown train.schedule {tc.schedule!r}; choose one of {list(SCHEDULES)}")
    parts = [optax.clip_by_global_norm(tc.grad_clip)] if tc.grad_clip else []
    parts.append(optax.adamw(base, weight_decay=tc.weight_decay))
    if tc.schedule == "plateau":
        parts.append(scale_by_plateau())
    return optax.chain(*parts), Schedule(base)
