"""Approximation error of a linearized model (paper, appendix "Approximation error").

For each linearized layer ℓ, on the teacher's own input to that layer,

    MSE^(ℓ)  = 1/(T d) ‖y_full^(ℓ) − y_lin^(ℓ)‖²
    nMSE^(ℓ) = MSE^(ℓ) / Var(y_full^(ℓ))      (empirical variance of the teacher's outputs)

with y the attention-block output (after o_proj). The per-token curve is the same
ratio at each token index, averaged over sequences and linearized layers. The
teacher is the original model; the student a linearization of it.

    linjax eval approx TEACHER STUDENT --data FILE --num-seqs N --seq-len L --out DIR
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from linjax import heartbeat
from linjax.eval.models import load_model
from linjax.files import pyplot, read_file_documents, write_figure, write_json
from linjax.mixers.softmax import SoftmaxAttention
from linjax.model import token_positions


def mse_and_nmse(full: np.ndarray, lin: np.ndarray) -> tuple[float, float]:
    """The appendix formulas for one layer: arrays [..., d] of teacher and student outputs."""
    full, lin = np.asarray(full, np.float64), np.asarray(lin, np.float64)
    mse = float(np.mean((full - lin) ** 2))
    return mse, mse / float(np.var(full))


def token_sequences(tokenizer, path: str, num_seqs: int, seq_len: int) -> np.ndarray:
    """`num_seqs` rows of `seq_len` tokens: the documents tokenised, joined with EOS, cut in order."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for text in read_file_documents(path):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        if len(ids) >= num_seqs * seq_len:
            break
    if len(ids) < num_seqs * seq_len:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than num_seqs × seq_len = {num_seqs * seq_len}; "
                         "ask for fewer or shorter sequences")
    return np.asarray(ids[:num_seqs * seq_len], np.int32).reshape(num_seqs, seq_len)


def check_student(teacher, student) -> list[int]:
    """Indices of the student's linearized layers; an error if it is not a linearization of the teacher."""
    if not all(isinstance(b.attn, SoftmaxAttention) for b in teacher.layers):
        raise ValueError("the teacher must be the original full-attention model (every layer softmax); "
                         "pass the base model, e.g. smollm2-135m, not a linearized run")
    if teacher.config != student.config:
        raise ValueError("the student's model config differs from the teacher's: it must be a linearization "
                         "of the same base model")
    linear = [i for i, b in enumerate(student.layers) if not isinstance(b.attn, SoftmaxAttention)]
    if not linear:
        raise ValueError("the student has no linearized layer (every layer is full attention)")
    q_teacher = np.asarray(teacher.layers[linear[0]].attn.proj.q_proj.kernel[...])
    q_student = np.asarray(student.layers[linear[0]].attn.proj.q_proj.kernel[...])
    if q_teacher.shape != q_student.shape or not np.array_equal(q_teacher, q_student):
        raise ValueError("the student's frozen attention weights differ from the teacher's: it is not a "
                         "linearization of this teacher")
    return linear


def _layer_outputs(teacher, student, linear: list[int]):
    """A jitted tokens [B,T] → (full, lin) [len(linear), B, T, d]: each linearized layer's attention output
    for the teacher and the student, both on the teacher's residual stream."""
    from flax import nnx

    t_def, t_state = nnx.split(teacher)
    s_def, s_state = nnx.split(student)

    @jax.jit
    def run(t_state, s_state, tokens):
        t, s = nnx.merge(t_def, t_state), nnx.merge(s_def, s_state)
        positions = token_positions(tokens)
        activations = t.attention_activations(tokens, positions)
        full = [activations[i].output.astype(jnp.float32) for i in linear]
        lin = [s.layers[i].attn(activations[i].input, positions).astype(jnp.float32) for i in linear]
        return jnp.stack(full), jnp.stack(lin)

    return lambda tokens: run(t_state, s_state, tokens)


def approximation_error(teacher, student, sequences: np.ndarray) -> dict:
    """Per-layer MSE/nMSE and per-token curves over `sequences` [N, T], one sequence at a time."""
    linear = check_student(teacher, student)
    outputs = _layer_outputs(teacher, student, linear)
    L, T = len(linear), sequences.shape[1]
    sq_err = np.zeros((L, T))  # Σ over sequences and d of (y_full − y_lin)²
    total, total_sq, count = np.zeros(L), np.zeros(L), 0
    d = None
    for row in sequences:
        full, lin = (np.asarray(a, np.float64)[:, 0] for a in outputs(jnp.asarray(row[None])))  # [L, T, d]
        d = full.shape[-1]
        sq_err += ((full - lin) ** 2).sum(-1)
        total += full.sum((1, 2))
        total_sq += (full ** 2).sum((1, 2))
        count += T * d
        heartbeat.progress()
    variance = total_sq / count - (total / count) ** 2
    mse = sq_err.sum(1) / count
    per_token_mse = sq_err / (len(sequences) * d)  # [L, T]
    per_token_nmse = per_token_mse / variance[:, None]
    return {"per_layer": [{"layer": layer, "mse": float(m), "nmse": float(m / v), "variance": float(v)}
                          for layer, m, v in zip(linear, mse, variance)],
            "per_token": {"mse": per_token_mse.mean(0).tolist(), "nmse": per_token_nmse.mean(0).tolist()},
            "per_layer_token_nmse": per_token_nmse.tolist(),
            "num_layers": len(teacher.layers), "num_seqs": len(sequences), "seq_len": int(T)}


def plot(result: dict, out_dir: str) -> list[str]:
    """approx_per_layer.png and approx_per_token.png; returns their paths."""
    plt = pyplot()
    paths = []
    layers = result["per_layer"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["layer"] for r in layers], [r["nmse"] for r in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("nMSE")
    ax.set_title("approximation error per layer")
    paths.append(write_figure(fig, os.path.join(out_dir, "approx_per_layer.png")))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    curve = result["per_token"]["nmse"]
    ax.plot(np.arange(len(curve)), curve, lw=1)
    ax.set_xlabel("token index")
    ax.set_ylabel("nMSE (mean over layers)")
    ax.set_yscale("log")
    ax.set_title("approximation error per token")
    paths.append(write_figure(fig, os.path.join(out_dir, "approx_per_token.png")))
    return paths


def run(teacher_spec: str, student_spec: str, *, data: str, num_seqs: int, seq_len: int, out_dir: str) -> dict:
    """Loads both models, measures, writes approx.json and the plots into out_dir; returns the result."""
    teacher, tokenizer, teacher_name = load_model(teacher_spec)
    student, _, student_name = load_model(student_spec)
    if tokenizer is None:
        raise ValueError(f"{teacher_spec} has no tokenizer; approximation error needs one to read {data}")
    sequences = token_sequences(tokenizer, data, num_seqs, seq_len)
    result = approximation_error(teacher, student, sequences)
    os.makedirs(out_dir, exist_ok=True)
    result.update(teacher=teacher_name, student=student_name, data=os.path.abspath(data),
                  plots=plot(result, out_dir))
    write_json(os.path.join(out_dir, "approx.json"), result)
    return result
