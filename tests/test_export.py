"""Export to PyTorch: the exported directory loads in a process without JAX and gives linjax's logits.

Two subprocesses per base model keep this cheap: one (JAX) builds and exports
every case and saves its tokens and logits, one (PyTorch, which must never
import JAX) loads every export and prints the max abs logit differences as JSON.

Coverage: every mechanism × adapter (None, shortconv, LoRA with B ≠ 0) × window
(none, w 64 s 0, w 56 s 8). To keep the number of compiles small, one case is a
6-layer model whose layers 0-4 are GLA, kGLA, GDN, gdn_scalar and Hedgehog and
whose layer 5 is kept as softmax attention (keep_full_attention, the hybrid):
an error in any layer shows in the logits. Both base models run the full adapter ×
window grid: LLaMA with llama3 RoPE and q/k/v/o biases, Qwen3 with q/k norm and tied
embeddings. The LLaMA run adds combine="mixed", a plain (not linearized) export that
must load as LlamaForCausalLM, and greedy generation against `linjax.generate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

MECHANISMS = ("gla", "kgla", "gdn", "gdn_scalar", "hedgehog")
ADAPTERS = (None, "shortconv", "lora")
WINDOWS = ((0, 0), (64, 0), (56, 8))
TOLERANCE = 1e-4
SEQUENCE = 150  # longer than the window, so the shifted linear term is exercised
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_config(model_type: str):
    from linjax.config import tiny_config

    if model_type == "llama":
        return tiny_config("llama", num_hidden_layers=6, attention_bias=True, rope_type="llama3", rope_factor=8.0)
    return tiny_config("qwen3", num_hidden_layers=6, tie_word_embeddings=True)


def grid():
    """(adapter, window, sinks) cases: every adapter with every window."""
    return [(a, w, s) for a in ADAPTERS for (w, s) in WINDOWS]


def build_case(model_type: str, adapter, window: int, sinks: int, combine: str = "sum", seed: int = 0):
    """A linearized tiny model: layers 0-4 one per mechanism, layer 5 softmax; new parameters randomised."""
    import jax
    from flax import nnx

    import linjax
    from linjax.layers import Trainable
    from linjax.linearize import MIXERS
    from linjax.model import CausalLM

    config = base_config(model_type)
    settings = linjax.LinearizeConfig(mechanism=MECHANISMS[0], adapter=adapter, window=window, sinks=sinks,
                                      combine=combine, keep_full_attention=(5,))
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
    for name, model in cases:
        linjax.save_hf(model, os.path.join(root, name))
        np.savez(os.path.join(root, name + ".npz"), tokens=tokens,
                 logits=np.asarray(forward(model, jnp.asarray(tokens))))
        manifest.append({"name": name, "kind": "linjax", "recurrent": name.endswith("shortconv-w56-s8")})
    if model_type == "llama":
        plain = CausalLM(base_config("llama"), rngs=nnx.Rngs(7))  # not linearized: the standard architecture
        linjax.save_hf(plain, os.path.join(root, "plain"))
        np.savez(os.path.join(root, "plain.npz"), tokens=tokens, logits=np.asarray(forward(plain, jnp.asarray(tokens))))
        manifest.append({"name": "plain", "kind": "LlamaForCausalLM"})
        # Greedy generation, against linjax.generate with its decode states.
        prompt = tokens[:1, :70]
        model = cases[-2][1]  # lora, window 56, sinks 8
        generated = np.asarray(linjax.generate(model, jnp.asarray(prompt), 20))
        np.savez(os.path.join(root, "generate.npz"), prompt=prompt, generated=generated)
        manifest.append({"name": cases[-2][0], "kind": "generate"})
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)


# Runs in a fresh interpreter: PyTorch + transformers only.
TORCH_CHECK = r"""
import json, os, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM

root = sys.argv[1]
results = {}
for case in json.load(open(os.path.join(root, "manifest.json"))):
    directory = os.path.join(root, case["name"])
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    if case["kind"] == "generate":
        data = np.load(os.path.join(root, "generate.npz"))
        out = model.generate(torch.tensor(data["prompt"], dtype=torch.long), max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, use_cache=False)
        results["generate"] = {"match": out.numpy().tolist() == data["generated"].tolist(),
                               "class": type(model).__name__}
        continue
    data = np.load(os.path.join(root, case["name"] + ".npz"))
    with torch.no_grad():
        logits = model(torch.tensor(data["tokens"], dtype=torch.long)).logits.float().numpy()
    results[case["name"]] = {"max_abs": float(np.abs(logits - data["logits"]).max()),
                             "class": type(model).__name__}
    if case.get("recurrent"):  # the token-by-token reference form of the linear layers, too
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "form"):
                layer.self_attn.form = "recurrent"
        with torch.no_grad():
            logits = model(torch.tensor(data["tokens"], dtype=torch.long)).logits.float().numpy()
        results[case["name"] + "-recurrent"] = {"max_abs": float(np.abs(logits - data["logits"]).max()),
                                                "class": type(model).__name__}
assert "jax" not in sys.modules, "the PyTorch export imported JAX"
print(json.dumps(results))
"""


def _run(args, cwd):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise AssertionError(f"subprocess failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_export_matches_linjax_without_jax(model_type, tmp_path):
    root = str(tmp_path)
    _run(["-c", f"from tests.test_export import write_cases; write_cases({model_type!r}, {root!r})"], cwd=ROOT)
    results = json.loads(_run(["-c", TORCH_CHECK, root], cwd=root).strip().splitlines()[-1])
    print(json.dumps(results, indent=1))
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    expected = {case["name"] for case in manifest if case["kind"] != "generate"}
    expected |= {case["name"] + "-recurrent" for case in manifest if case.get("recurrent")}
    assert expected <= set(results), f"missing results: {sorted(expected - set(results))}"
    for name in expected:
        result = results[name]
        assert result["max_abs"] <= TOLERANCE, f"{name}: max abs logit difference {result['max_abs']:.2e}"
        want = "LlamaForCausalLM" if name == "plain" else "LinjaxForCausalLM"
        assert result["class"] == want, f"{name} loaded as {result['class']}, expected {want}"
    if model_type == "llama":
        assert results["generate"]["match"], "PyTorch greedy generation differs from linjax.generate"


def test_export_rejects_plain_model(tmp_path):
    from flax import nnx

    from linjax.convert.export import export_hf
    from linjax.model import CausalLM

    model = CausalLM(base_config("llama"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="linearized"):
        export_hf(model, str(tmp_path / "out"))
