"""The PyTorch side of the export parity tests (tests/test_export.py, test_export_retention.py,
test_liger_gla.py): run in a fresh interpreter that must never import JAX, so this module imports
only the standard library and NumPy at the top, and torch inside its functions.

Each folder the JAX side writes holds exports, the logits and greedy tokens linjax gave, and a
manifest.json: a list of cases (kind "linjax", "generate" or "LlamaForCausalLM") or, for retained
tokens, {"retention": [case, ...], "prompt": P, "new_tokens": N}.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def assert_no_jax():
    assert "jax" not in sys.modules, "the PyTorch export imported JAX"


def check_all(root: str) -> dict:
    """{folder: results} for every folder under `root` with a manifest; then that JAX was never imported."""
    results = {}
    for folder in sorted(os.listdir(root)):
        path = os.path.join(root, folder)
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            continue
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        if isinstance(manifest, dict):
            results[folder] = check_retention_exports(path, manifest["retention"], manifest["prompt"],
                                                      manifest["new_tokens"])
        else:
            results[folder] = check_exports(path)
    assert_no_jax()
    return results


def check_exports(root: str) -> dict:
    """PyTorch side (run in a fresh interpreter without JAX): load every export listed in root's manifest
    and compare it with the logits and greedy tokens linjax saved. {case: result}."""
    import torch
    from transformers import AutoModelForCausalLM

    def set_form(model, form):  # "recurrent": the linear layers' token-by-token reference form
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "form"):
                layer.self_attn.form = form

    def max_abs_logits(model, data):
        with torch.no_grad():
            logits = model(torch.tensor(data["tokens"], dtype=torch.long)).logits.float().numpy()
        return {"max_abs": float(np.abs(logits - data["logits"]).max()), "class": type(model).__name__}

    results, models = {}, {}
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    for case in manifest:
        name = case["name"]
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(os.path.join(root, name), trust_remote_code=True,
                                                                dtype=torch.float32).eval()
        model = models[name]
        if case["kind"] == "generate":  # greedy, with LinjaxCache and recomputing the prefix
            data = np.load(os.path.join(root, name + ".generate.npz"))
            prompt = torch.tensor(data["prompt"], dtype=torch.long)
            new = data["generated"].shape[1] - prompt.shape[1]
            for use_cache in (True, False):
                out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     use_cache=use_cache)
                results[f"{name}-generate-cache{int(use_cache)}"] = {
                    "match": out.numpy().tolist() == data["generated"].tolist()}
            continue
        data = np.load(os.path.join(root, name + ".npz"))
        results[name] = max_abs_logits(model, data)
        if case.get("recurrent"):
            set_form(model, "recurrent")
            results[name + "-recurrent"] = max_abs_logits(model, data)
            set_form(model, "auto")
    return results


def check_retention_exports(root: str, cases: list, prompt: int, new_tokens: int) -> dict:
    """Each retained-token case's export (tests/test_export_retention.py) against linjax's logits, decoded
    in pieces with LinjaxCache, repeated along the batch, and generating greedily."""
    import torch
    from transformers import AutoModelForCausalLM

    def retained_shapes(cache):
        return [tuple(x.shape) for layer in cache.layers if getattr(layer, "retained", None) is not None
                for value in layer.retained.tensors().values() for x in (value if isinstance(value, list) else [value])]

    def cache_of(out):  # a LinjaxCache, advanced in place
        return out.cache if hasattr(out, "cache") else out.past_key_values

    results = {}
    for name in cases:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(root, name), trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        data = np.load(os.path.join(root, name + ".npz"))
        tokens = torch.tensor(data["tokens"], dtype=torch.long)
        result = {"config": {k: model.config.linearize[k] for k in ("retain", "retain_score", "conv_on_window",
                                                                    "retain_block")}}
        with torch.no_grad():
            full = model(tokens).logits
            result["max_abs"] = float(np.abs(full.numpy() - data["logits"]).max())
            # Prefill, then a chunk of five, then one token at a time, continuing one LinjaxCache.
            out = model(tokens[:, :17], use_cache=True)
            cache = cache_of(out)
            pieces = [out.logits]
            after_prefill = retained_shapes(cache)
            pieces.append(model(tokens[:, 17:22], cache=cache, use_cache=True).logits)
            for t in range(22, tokens.shape[1]):
                pieces.append(model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits)
            result["decode_max_abs"] = float((torch.cat(pieces, dim=1) - full).abs().max())
            result["retained_layers"] = sum(getattr(layer, "retained", None) is not None for layer in cache.layers)
            result["shapes_fixed"] = bool(after_prefill) and retained_shapes(cache) == after_prefill
            result["held"] = sorted({int(p) for layer in cache.layers if getattr(layer, "retained", None) is not None
                                     for p in layer.retained.position.flatten().tolist()})
            # lm-eval's shared prefixes: one row's cache repeated along the batch, then its continuations.
            cache = cache_of(model(tokens[:1, :17], use_cache=True))
            cache.batch_repeat_interleave(2)
            rows = model(tokens[[0, 0], 17:], cache=cache, use_cache=True).logits
            result["repeated_max_abs"] = float((rows - full[:1, 17:]).abs().max())
        # Greedy generation with LinjaxCache against recomputing the whole prefix (the full forward) every step.
        generated = [model.generate(tokens[:1, :prompt], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, use_cache=use_cache)[0].tolist() for use_cache in (True, False)]
        result["generate_match"] = generated[0] == generated[1]
        results[name] = result
    return results
