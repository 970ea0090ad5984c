"""The paper's assumption checks (appendix "Assumption checks"), from the frozen model's keys.

With k̃_i = k_i / (‖k_i‖ + ε) the RoPE'd key of a layer and kv head, and
k̄_t = (1/t) Σ_{j≤t} k̃_j its running mean:

    key concentration    C_t = cos(k̃_t, k̄_t)                                  (Lemma 3)
    projection residual  R_t = (1/t) Σ_{i≤t} ‖Π_{k̄_t} k̃_i − k̄_t‖,
                         Π_{k̄} = k̄ k̄ᵀ / (‖k̄‖² + ε)                            (Lemma 2, Eq. residual)

(the residual's inner term (k̃_i − k̄_t) − (I − Π)k̃_i simplifies to Π k̃_i − k̄_t).
Averaged over sequences, layers and heads they give the token-index curves; with a
student, token positions are binned by C and by R and the student's nMSE is
averaged within each bin.

    linjax eval diagnostics SOURCE --data FILE [--student S] --num-seqs N --seq-len L --out DIR
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from linjax import heartbeat
from linjax.eval.approx import approximation_error, token_sequences
from linjax.eval.models import load_model
from linjax.files import pyplot, write_figure, write_json
from linjax.model import token_positions

EPS = 1e-6


def concentration_and_residual(keys: jax.Array, eps: float = EPS):
    """keys [..., T, D] → (C [..., T], R [..., T]), exactly the appendix formulas (fp32)."""
    k = keys.astype(jnp.float32)
    k = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + eps)
    t = jnp.arange(1, k.shape[-2] + 1, dtype=jnp.float32)[:, None]
    mean = jnp.cumsum(k, axis=-2) / t                                    # k̄_t
    mean_norm = jnp.linalg.norm(mean, axis=-1)
    concentration = jnp.sum(k * mean, axis=-1) / (jnp.linalg.norm(k, axis=-1) * mean_norm + eps)
    # ‖Π k̃_i − k̄_t‖ = ‖k̄_t‖ · |k̄_t·k̃_i / (‖k̄_t‖² + ε) − 1|, for all (t, i) at once.
    dots = jnp.einsum("...td,...id->...ti", mean, k)
    per_pair = mean_norm[..., None] * jnp.abs(dots / (mean_norm[..., None] ** 2 + eps) - 1.0)
    causal = jnp.tril(jnp.ones((k.shape[-2], k.shape[-2]), bool))
    residual = jnp.sum(jnp.where(causal, per_pair, 0.0), axis=-1) / t[:, 0]
    return concentration, residual


def _keys_per_layer(model):
    """A jitted tokens [1,T] → keys [layers, Hkv, T, D] of every layer (post-RoPE), on the model's own stream."""
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        positions = token_positions(tokens)
        keys = []
        for block, layer in zip(m.layers, m.attention_activations(tokens, positions)):
            _, k, _ = block.attn.proj.qkv(layer.input, positions)
            keys.append(jnp.moveaxis(k[0], 1, 0))                       # [Hkv, T, D]
        return jnp.stack(keys)

    return lambda tokens: run(state, tokens)


def diagnostics(model, sequences: np.ndarray, student=None, bins: int = 10) -> dict:
    """Token-index curves of C and R, per-layer means, and (with a student) nMSE binned by C and R."""
    keys_of = _keys_per_layer(model)
    measure = jax.jit(concentration_and_residual)
    c_sum = r_sum = None
    for row in sequences:
        c, r = (np.asarray(a, np.float64) for a in measure(keys_of(jnp.asarray(row[None]))))  # [L, Hkv, T]
        c_sum = c if c_sum is None else c_sum + c
        r_sum = r if r_sum is None else r_sum + r
        heartbeat.progress()
    c_mean, r_mean = c_sum / len(sequences), r_sum / len(sequences)
    result = {"num_layers": int(c_mean.shape[0]), "num_seqs": len(sequences), "seq_len": int(sequences.shape[1]),
              "per_token": {"concentration": c_mean.mean((0, 1)).tolist(), "residual": r_mean.mean((0, 1)).tolist()},
              "per_layer": [{"layer": i, "concentration": float(c_mean[i].mean()), "residual": float(r_mean[i].mean())}
                            for i in range(c_mean.shape[0])],
              "per_layer_head_token": {"concentration": c_mean.tolist(), "residual": r_mean.tolist()}}
    if student is not None:
        errors = approximation_error(model, student, sequences)
        layers = [r["layer"] for r in errors["per_layer"]]
        nmse = np.asarray(errors["per_layer_token_nmse"])                  # [linear layers, T]
        # Each (layer, head, t) takes its layer's nMSE at t (the error is measured after o_proj).
        nmse = np.broadcast_to(nmse[:, None, :], c_mean[layers].shape)
        result["binned_nmse"] = {name: _binned(values[layers], nmse, bins)
                                 for name, values in (("concentration", c_mean), ("residual", r_mean))}
        result["approx"] = {"per_layer": errors["per_layer"]}
    return result


def _binned(values: np.ndarray, nmse: np.ndarray, bins: int) -> list[dict]:
    """Quantile bins of `values`; the mean nMSE of the positions in each."""
    values, nmse = values.ravel(), nmse.ravel()
    edges = np.quantile(values, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, bins - 1)
    return [{"low": float(edges[b]), "high": float(edges[b + 1]), "count": int((which == b).sum()),
             "nmse": float(nmse[which == b].mean()) if (which == b).any() else None} for b in range(bins)]


def plot(result: dict, out_dir: str) -> list[str]:
    plt = pyplot()
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, name in zip(axes, ("concentration", "residual")):
        curve = result["per_token"][name]
        ax.plot(np.arange(1, len(curve) + 1), curve, lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("token index")
        ax.set_ylabel({"concentration": "key concentration C_t", "residual": "projection residual R_t"}[name])
    paths.append(write_figure(fig, os.path.join(out_dir, "diagnostics_per_token.png")))
    if "binned_nmse" in result:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, name in zip(axes, ("concentration", "residual")):
            rows = [r for r in result["binned_nmse"][name] if r["nmse"] is not None]
            ax.plot([(r["low"] + r["high"]) / 2 for r in rows], [r["nmse"] for r in rows], "o-")
            ax.set_xlabel(name)
            ax.set_ylabel("nMSE")
        paths.append(write_figure(fig, os.path.join(out_dir, "diagnostics_binned_nmse.png")))
    return paths


def run(source: str, *, data: str, num_seqs: int, seq_len: int, out_dir: str, student: str | None = None) -> dict:
    model, tokenizer, name = load_model(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer; diagnostics need one to read {data}")
    student_model = None if student is None else load_model(student)[0]
    sequences = token_sequences(tokenizer, data, num_seqs, seq_len)
    result = diagnostics(model, sequences, student_model)
    os.makedirs(out_dir, exist_ok=True)
    result.update(model=name, student=student, data=os.path.abspath(data), plots=plot(result, out_dir))
    write_json(os.path.join(out_dir, "diagnostics.json"), result)
    return result
