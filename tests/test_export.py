"""Export to PyTorch: the exported directory loads in a process without JAX and gives linjax's logits.

Two subprocesses for the whole parity grid keep this cheap (test_exports_match_linjax_without_jax):
one (JAX) builds and exports every case of both base models and of tests/test_export_retention.py
and saves its tokens and logits, one (PyTorch, tests/pytorch_side.py, which must never import JAX)
loads every export and returns the max abs logit differences as JSON.

Coverage: every mechanism × adapter (None, shortconv, LoRA with B ≠ 0) × window
(none, w 64 s 0, w 56 s 8). To keep the number of compiles small, one case is a
model with one layer per linear mechanism of the mixer registry and a last layer
kept as softmax attention (keep_full_attention, the hybrid):
an error in any layer shows in the logits. Both base models run the full adapter ×
window grid: LLaMA with llama3 RoPE and q/k/v/o biases, Qwen3 with q/k norm and tied
embeddings. The LLaMA run adds combine="mixed", the window-only baseline (mechanism
"window", w56 s8), a set `scale` with learned per-head output gains (moved off 1, as
every new parameter) at w56 s8 and without a window, and a plain (not linearized) export that
must load as LlamaForCausalLM. Greedy generation (20 tokens after a 70-token prompt, so
the window and the shifted linear inputs roll over while decoding) is checked against
`linjax.generate` with the cache and without it (every mechanism each time): LLaMA LoRA
w56 s8, shortconv "mixed" w56 s8, window-only w56 s8 and scale + gain w56 s8, Qwen3 shortconv without a
window and plain w64 s0.

Also here: FLA's chunk-kernel adapter (`fla_linear`) against the PyTorch chunked form,
run with FLA's naive references in place of the CUDA kernels, and the real SmolLM2-135M
linearized with GDN + window 56 + sinks 8 + shortconv (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import linear_mechanisms, python_environment, require_embedded_model

MECHANISMS = linear_mechanisms()
LAYERS = len(MECHANISMS) + 1  # one per mechanism, then one kept as softmax attention
SOFTMAX_LAYER = LAYERS - 1
ADAPTERS = (None, "shortconv", "lora")
WINDOWS = ((0, 0), (64, 0), (56, 8))
TOLERANCE = 1e-4
# SmolLM2-135M: 30 layers, logits up to ~36. The same code and versions give a max abs difference of
# 6.8e-5 on an AMD EPYC (AVX2) and 1.25e-4 on an Intel Xeon (AVX-512): both frameworks' fp32 matmuls
# round in the order their CPU kernels block the sums. On that Xeon the same commit gave 1.25e-4 run
# alone and 2.65e-4 inside the full suite (xdist workers sharing one XLA compilation cache), with the
# same 20 greedy tokens. The bound keeps about a 2x margin over the worst seen (relative to the logit
# scale: 1.4e-5); the 20 greedy tokens must still be identical.
SMOLLM2_TOLERANCE = 5e-4
SEQUENCE = 150  # longer than the window, so the shifted linear term is exercised


def base_config(model_type: str):
    from linjax.config import tiny_config

    if model_type == "llama":
        return tiny_config("llama", num_hidden_layers=LAYERS, attention_bias=True, rope_type="llama3", rope_factor=8.0)
    return tiny_config("qwen3", num_hidden_layers=LAYERS, tie_word_embeddings=True)


def grid():
    """(adapter, window, sinks) cases: every adapter with every window."""
    return [(a, w, s) for a in ADAPTERS for (w, s) in WINDOWS]


def build_case(model_type: str, adapter, window: int, sinks: int, combine: str = "sum", seed: int = 0, **extra):
    """A linearized tiny model: one layer per mechanism, the last one softmax; new parameters randomised
    (the output gains too, with `output_gain=True` in `extra`, the further LinearizeConfig settings)."""
    import jax
    from flax import nnx

    import linjax
    from linjax.layers import Trainable
    from linjax.linearize import MIXERS
    from linjax.model import CausalLM

    config = base_config(model_type)
    settings = linjax.LinearizeConfig(mechanism=MECHANISMS[0], adapter=adapter, window=window, sinks=sinks,
                                      combine=combine, keep_full_attention=(SOFTMAX_LAYER,), **extra)
    model = linjax.linearize(CausalLM(config, rngs=nnx.Rngs(seed)), settings, seed=seed)
    for i, mechanism in enumerate(MECHANISMS[1:], start=1):
        model.layers[i].attn = MIXERS[mechanism](model.layers[i].attn.proj, settings, rngs=nnx.Rngs(seed + i))
    # Move every new parameter off its initial value (LoRA's B starts at zero, Hedgehog's maps at I).
    # LoRA gets a small step: a large one would blow up the attention scores and make the
    # comparison measure softmax's conditioning instead of the export.
    state = nnx.state(model, Trainable)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [x + (0.02 if "lora" in jax.tree_util.keystr(path) else 0.3) * jax.random.normal(k, x.shape, x.dtype)
              for (path, x), k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def window_only_case(model_type: str, seed: int = 0):
    """The window-only baseline (sinks + window softmax, no linear term) with the last layer kept as full attention."""
    from flax import nnx

    import linjax
    from linjax.model import CausalLM

    settings = linjax.LinearizeConfig(mechanism="window", window=56, sinks=8, keep_full_attention=(SOFTMAX_LAYER,))
    return linjax.linearize(CausalLM(base_config(model_type), rngs=nnx.Rngs(seed)), settings, seed=seed)


GENERATE_CASES = {"llama": ("llama-lora-w56-s8", "llama-mixed-w56-s8", "llama-window-w56-s8",
                            "llama-scale-gain-w56-s8", "llama-conv-on-window-w56-s8"),
                  "qwen3": ("qwen3-shortconv-w0-s0", "qwen3-None-w64-s0")}
PROMPT = 70  # > window + sinks: decoding crosses into the linear state
NEW_TOKENS = 20


def write_cases(model_type: str, root: str):
    """JAX side (run in a subprocess): export every case to root/<name>/ and save tokens + logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import linjax
    from linjax.model import CausalLM

    jax.config.update("jax_disable_most_optimizations", True)  # compile time dominates here
    tokens = np.random.default_rng(0).integers(0, 128, (2, SEQUENCE)).astype(np.int32)
    forward = nnx.jit(lambda model, t: model(t))
    manifest = []
    cases = [(f"{model_type}-{a}-w{w}-s{s}", build_case(model_type, a, w, s)) for a, w, s in grid()]
    if model_type == "llama":
        cases.append((f"{model_type}-mixed-w56-s8", build_case(model_type, "shortconv", 56, 8, combine="mixed")))
        cases.append((f"{model_type}-window-w56-s8", window_only_case(model_type)))
        cases.append((f"{model_type}-conv-on-window-w56-s8", build_case(model_type, "shortconv", 56, 8,
                                                                        conv_on_window=True)))
        # LoRA on top of the short conv (a second stage adding LoRA): merged into q/k/v/o, conv as usual.
        cases.append((f"{model_type}-shortconv-lora-w56-s8", build_case(model_type, "shortconv+lora", 56, 8)))
        # A set scale (1, the paper's y = qᵀS; 0.5) and learned per-head gains, with a window and without.
        cases.append((f"{model_type}-scale-gain-w56-s8", build_case(model_type, None, 56, 8, scale=1.0,
                                                                    output_gain=True)))
        cases.append((f"{model_type}-scale-gain-w0-s0", build_case(model_type, None, 0, 0, scale=0.5,
                                                                   output_gain=True)))
    for name, model in cases:
        linjax.save_hf(model, os.path.join(root, name))
        np.savez(os.path.join(root, name + ".npz"), tokens=tokens,
                 logits=np.asarray(forward(model, jnp.asarray(tokens))))
        manifest.append({"name": name, "kind": "linjax", "recurrent": name.endswith("shortconv-w56-s8")})
        if name in GENERATE_CASES[model_type]:  # greedy, against linjax.generate with its decode states
            prompt = tokens[:1, :PROMPT]
            generated = np.asarray(linjax.generate(model, jnp.asarray(prompt), NEW_TOKENS))
            np.savez(os.path.join(root, name + ".generate.npz"), prompt=prompt, generated=generated)
            manifest.append({"name": name, "kind": "generate"})
    if model_type == "llama":
        plain = CausalLM(base_config("llama"), rngs=nnx.Rngs(7))  # not linearized: the standard architecture
        linjax.save_hf(plain, os.path.join(root, "plain"))
        np.savez(os.path.join(root, "plain.npz"), tokens=tokens, logits=np.asarray(forward(plain, jnp.asarray(tokens))))
        manifest.append({"name": "plain", "kind": "LlamaForCausalLM"})
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)


# A fresh interpreter's PyTorch check of the exports under sys.argv[1] (tests/test_liger_gla.py).
TORCH_CHECK = ("import json, sys; from tests.pytorch_side import check_exports, assert_no_jax; "
               "results = check_exports(sys.argv[1]); assert_no_jax(); print(json.dumps(results))")


def _run(args, cwd, timeout=600):
    env = python_environment(TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise AssertionError(f"subprocess failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


MODEL_TYPES = ("llama", "qwen3")


def write_all_cases(root: str):
    """JAX side, one process: every parity case of this file and of tests/test_export_retention.py."""
    from tests.test_export_retention import write_retention_cases

    for model_type in MODEL_TYPES:
        os.makedirs(os.path.join(root, model_type))
        write_cases(model_type, os.path.join(root, model_type))
    os.makedirs(os.path.join(root, "retention"))
    write_retention_cases(os.path.join(root, "retention"))


@pytest.mark.timeout(2700)  # the whole grid, in two processes
def test_exports_match_linjax_without_jax(tmp_path):
    """The parity grid: both base models' cases (below) and the retained-token cases
    (tests/test_export_retention.py), exported by one JAX process and checked by one PyTorch process.
    Every part is checked, and every failure reported, before the test fails."""
    from tests.test_export_retention import check_retention_results

    root = str(tmp_path)
    _run(["-c", f"from tests.test_export import write_all_cases; write_all_cases({root!r})"], cwd=root, timeout=1500)
    check = f"import json; from tests.pytorch_side import check_all; print(json.dumps(check_all({root!r})))"
    results = json.loads(_run(["-c", check], cwd=root, timeout=900).strip().splitlines()[-1])
    print(json.dumps(results, indent=1))
    parts = {model_type: lambda m=model_type: check_model_results(m, os.path.join(root, m), results[m])
             for model_type in MODEL_TYPES}
    parts["retention"] = lambda: check_retention_results(os.path.join(root, "retention"), results["retention"])
    failures = []
    for part, check_part in parts.items():
        try:
            check_part()
        except AssertionError as error:
            failures.append(f"{part}: {error}")
    assert not failures, "\n".join(failures)


def check_model_results(model_type: str, root: str, results: dict):
    """Every case of `write_cases(model_type)` loaded as the right class, within TOLERANCE of linjax's logits,
    and generated linjax's greedy tokens with the cache and without it."""
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    expected = {case["name"] for case in manifest if case["kind"] != "generate"}
    expected |= {case["name"] + "-recurrent" for case in manifest if case.get("recurrent")}
    generated = {f"{case['name']}-generate-cache{c}" for case in manifest if case["kind"] == "generate" for c in (0, 1)}
    assert len(generated) == 2 * len(GENERATE_CASES[model_type]) and (expected | generated) <= set(results), \
        f"missing results: {sorted((expected | generated) - set(results))}"
    for name in expected:
        result = results[name]
        assert result["max_abs"] <= TOLERANCE, f"{name}: max abs logit difference {result['max_abs']:.2e}"
        want = "LlamaForCausalLM" if name == "plain" else "LinjaxForCausalLM"
        assert result["class"] == want, f"{name} loaded as {result['class']}, expected {want}"
    for name in generated:
        assert results[name]["match"], f"{name}: PyTorch greedy generation differs from linjax.generate"


def test_export_rejects_plain_model(tmp_path):
    from flax import nnx

    from linjax.convert.export import export_hf
    from linjax.model import CausalLM

    model = CausalLM(base_config("llama"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="linearized"):
        export_hf(model, str(tmp_path / "out"))


# ----------------------------------------------------------------------------- FLA's chunk kernels


def _fla_naive_kernels():
    """FLA's naive PyTorch references under the names and keyword arguments of its chunk kernels."""
    from tests.kernels.fla_oracle import fla_naive

    gla, kda, gdr, linear = (fla_naive(sub) for sub in ("gla", "kda", "gated_delta_rule", "linear_attn"))

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
        # naive_recurrent_gla fixes scale = K^-1/2 and calls the gate gk: fold the scale into q.
        return gla.naive_recurrent_gla(q * (scale * q.shape[-1] ** 0.5), k, v, g, initial_state=initial_state,
                                       output_final_state=output_final_state)

    return {"gla": chunk_gla, "kda": kda.naive_recurrent_kda, "gated_delta_rule": gdr.naive_recurrent_gated_delta_rule,
            "linear_attn": linear.naive_recurrent_linear_attn}


@pytest.mark.parametrize("kind", MECHANISMS)
def test_fla_adapter_matches_pytorch_chunked(kind):
    """`fla_linear`'s argument mapping (gate format, scale, state layout, initial and final state): FLA's naive
    references in place of the CUDA chunk kernels must give `chunked_linear`'s output and final state."""
    import jax
    import torch

    from linjax.convert import modeling_linjax as ml
    from linjax.linearize import LINEAR_MIXERS

    kernels = _fla_naive_kernels()
    mixer = LINEAR_MIXERS[kind]
    B, T, H, D = 2, 37, 3, 16  # T not a multiple of any chunk size; the mirror's q, k, v are on the H query heads
    q, k, v, *gates = (torch.from_numpy(np.array(x)) for x in
                       mixer.example_inputs(jax.random.key(0), batch=B, time=T, heads=H, kv_heads=H, head_dim=D))
    if mixer.normalized:  # the mirror carries the normaliser as v's last column: v → [v, 1]
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    Dk, Dv = q.shape[-1], v.shape[-1]
    scale = Dk ** -0.5 if mixer.linear_scale is None else mixer.linear_scale
    state = 0.3 * torch.randn(B, H, Dk, Dv, generator=torch.Generator().manual_seed(0))
    for initial_state in (None, state):
        want, want_state = ml.chunked_linear(kind, q, k, v, gates, scale, initial_state)
        got, got_state = ml.fla_linear(kind, q, k, v, gates, scale, initial_state, kernels=kernels)
        assert got.shape == want.shape and got_state.shape == want_state.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    # On a machine without CUDA the default form is the PyTorch one, FLA installed or not.
    if not torch.cuda.is_available():
        assert ml.fla_kernels() is None
        got, _ = ml.run_linear("auto", kind, q, k, v, gates, scale, state)
        torch.testing.assert_close(got, ml.chunked_linear(kind, q, k, v, gates, scale, state)[0], rtol=0, atol=0)


# ----------------------------------------------------------------------------- SmolLM2-135M


SMOLLM2_TOKENS = 96  # logits over positions 64-95 read the linear state (window 56 + sinks 8 = 64)
SMOLLM2_PROMPT = 72


def write_smollm2_case(root: str):
    """JAX side: SmolLM2-135M linearized (GDN, window 56, sinks 8, shortconv), new parameters moved off their
    init, exported to root/smollm2 with its logits and a 20-token greedy continuation from linjax.generate."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import linjax
    from linjax.layers import Trainable

    jax.config.update("jax_disable_most_optimizations", True)
    base, tokenizer = linjax.load("smollm2-135m")
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv"))
    # Each new array moves by half its own spread (0.1 where it is constant, e.g. β's bias), so the gates,
    # β and the conv filters are far from their initial values.
    state = nnx.state(model, Trainable)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.5 * jnp.maximum(jnp.std(x), 0.2) * jax.random.normal(key, x.shape, x.dtype)
              for x, key in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    with open(__file__) as f:
        tokens = np.asarray([tokenizer(f.read())["input_ids"][:SMOLLM2_TOKENS]], np.int32)
    assert tokens.shape == (1, SMOLLM2_TOKENS)
    linjax.save_hf(model, os.path.join(root, "smollm2"))
    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens))
    prompt = tokens[:, :SMOLLM2_PROMPT]
    generated = np.asarray(linjax.generate(model, jnp.asarray(prompt), NEW_TOKENS))
    np.savez(os.path.join(root, "smollm2.npz"), tokens=tokens, logits=np.asarray(logits), prompt=prompt,
             generated=generated)


SMOLLM2_CHECK = r"""
import json, os, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM

root = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "smollm2"), trust_remote_code=True,
                                             dtype=torch.float32).eval()
data = np.load(os.path.join(root, "smollm2.npz"))
with torch.no_grad():
    logits = model(torch.tensor(data["tokens"], dtype=torch.long)).logits.numpy()
prompt = torch.tensor(data["prompt"], dtype=torch.long)
new = data["generated"].shape[1] - prompt.shape[1]
out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
assert "jax" not in sys.modules, "the PyTorch export imported JAX"
print(json.dumps({"max_abs": float(np.abs(logits - data["logits"]).max()),
                  "logit_scale": float(np.abs(data["logits"]).max()),
                  "generated": out[0].tolist(), "expected": data["generated"][0].tolist()}))
"""


@pytest.mark.slow
def test_smollm2_export_matches_linjax_without_jax(tmp_path):
    """The real SmolLM2-135M, linearized with the paper's recipe: logits within 2.5e-4 and the same 20 greedy
    tokens (PyTorch decoding with LinjaxCache against linjax.generate)."""
    require_embedded_model()
    root = str(tmp_path)
    _run(["-c", f"from tests.test_export import write_smollm2_case; write_smollm2_case({root!r})"], cwd=root)
    result = json.loads(_run(["-c", SMOLLM2_CHECK, root], cwd=root).strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["max_abs"] <= SMOLLM2_TOLERANCE, f"max abs logit difference {result['max_abs']:.2e}"
    assert result["generated"] == result["expected"], "PyTorch greedy generation differs from linjax.generate"
