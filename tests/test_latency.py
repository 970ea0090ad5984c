"""The latency benchmark (eval/latency.py, eval/latency_point.py): correctness only, never timings."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.app.cli import build_parser, main
from linjax.config import tiny_config
from linjax.eval import latency
from linjax.eval.latency_point import (
    build_linjax_model,
    cache_bytes_per_layer,
    greedy_step_function,
    kv_cache_bytes,
    random_states,
    state_bytes,
    state_shapes,
    with_length,
)
from linjax.model import CausalLM
from tests.helpers import require_module

BATCH, LENGTH, NEW = 2, 70, 3  # 70 > sinks + window = 64: the stand-in's window ring counts as full


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random LLaMA (2 layers, 4 query and 2 kv heads) as an HF directory transformers loads."""
    model = CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0))
    return linjax.save_hf(model, str(tmp_path_factory.mktemp("latency") / "tiny"))


@pytest.fixture(scope="module")
def tiny_models(tiny_hf_dir):
    return {impl: build_linjax_model(tiny_hf_dir, impl, retain=4) for impl in ("full", "linearized", "retained")}


def counters(states):
    """The token counters: integer scalars (a retained token's position is an integer array, not a counter)."""
    return [int(x) for x in jax.tree.leaves(states) if jnp.issubdtype(x.dtype, jnp.integer) and x.shape == ()]


@pytest.mark.parametrize("impl", ["full", "linearized", "retained"])
def test_random_stand_in_has_the_shapes_of_a_real_prefill_and_decodes(tiny_models, impl):
    model = tiny_models[impl]
    step, params = greedy_step_function(model)
    prompt = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, model.config.vocab_size, jnp.int32)
    _, prefilled = step(params, prompt, model.init_states(BATCH, LENGTH + NEW))
    stand_in = random_states(state_shapes(model, BATCH, LENGTH + NEW), LENGTH, seed=3)

    assert jax.tree.structure(stand_in) == jax.tree.structure(prefilled)
    for real, fake in zip(jax.tree.leaves(prefilled), jax.tree.leaves(stand_in)):
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    assert counters(stand_in) == counters(prefilled) == [LENGTH] * len(counters(prefilled))

    graphdef, _ = nnx.split(model)
    one_step = jax.jit(lambda params, token, states: nnx.merge(graphdef, params)(token, states=states))
    logits, after_one = one_step(params, jnp.zeros((BATCH, 1), jnp.int32), stand_in)
    assert logits.shape == (BATCH, 1, model.config.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
    assert set(counters(after_one)) == {LENGTH + 1}

    token, states = jnp.zeros((BATCH, 1), jnp.int32), stand_in
    for _ in range(NEW):  # the benchmark's loop: jitted, states donated
        token, states = step(params, token, states)
    assert token.shape == (BATCH, 1) and set(counters(states)) == {LENGTH + NEW}
    assert set(counters(with_length(states, LENGTH))) == {LENGTH}  # the rewind between timed runs


def test_linear_state_is_the_same_size_at_every_length_and_the_kv_cache_grows_linearly(tiny_models, tiny_hf_dir):
    linear, full = tiny_models["linearized"], tiny_models["full"]
    assert state_bytes(state_shapes(linear, 8, 1024)) == state_bytes(state_shapes(linear, 8, 32768))
    with open(os.path.join(tiny_hf_dir, "config.json")) as f:
        config = json.load(f)
    counter_bytes = 4 * config["num_hidden_layers"]  # one int32 length per layer
    for tokens in (1024, 32768):
        assert state_bytes(state_shapes(full, 8, tokens)) == kv_cache_bytes(config, 8, tokens) + counter_bytes
    assert kv_cache_bytes(config, 8, 32768) == 32 * kv_cache_bytes(config, 8, 1024)


def test_transformers_stand_in_cache_holds_l_random_positions_and_decodes(tiny_hf_dir):
    torch = require_module("torch")
    from transformers import AutoModelForCausalLM

    from linjax.eval.latency_point import random_dynamic_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    cache = random_dynamic_cache(model, BATCH, LENGTH, seed=0)
    config = model.config
    assert cache.get_seq_length() == LENGTH
    assert tuple(cache.layers[0].keys.shape) == (BATCH, config.num_key_value_heads, LENGTH, config.head_dim)
    with torch.no_grad():
        out = model(input_ids=torch.zeros((BATCH, 1), dtype=torch.long), past_key_values=cache, use_cache=True,
                    position_ids=torch.full((BATCH, 1), LENGTH))
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == LENGTH + 1


@pytest.mark.parametrize("impl", ["full", "transformers"])
def test_a_point_with_the_real_prefill(tiny_hf_dir, impl):
    """The `--real-prefill` path of a point, measured in this process (the benchmark runs it in its own)."""
    if impl == "transformers":
        require_module("torch")
    from linjax.eval.latency_point import measure_linjax, measure_transformers

    settings = {"length": 16, "batch": BATCH, "decode_tokens": 2, "repeats": 2, "real_prefill": True}
    point = (measure_linjax(impl, source=tiny_hf_dir, **settings) if impl == "full"
             else measure_transformers(hf_dir=tiny_hf_dir, **settings))
    assert point["prefill_s"] > 0 and len(point["decode_s_runs"]) == 2 and min(point["decode_s_runs"]) > 0
    assert point["peak_rss_bytes"] > 0 and point["baseline_rss_bytes"] > 0
    with open(os.path.join(tiny_hf_dir, "config.json")) as f:
        assert point["state_bytes"] >= kv_cache_bytes(json.load(f), BATCH, 16 + 2)


def test_end_to_end_writes_json_table_plot_and_records_what_did_not_fit(tiny_hf_dir, tmp_path):
    """A memory limit below the smallest KV cache: full attention does not fit (it is not started),
    and the linearized model, with and without retained tokens, runs in its own process."""
    out = tmp_path / "latency"
    lines = []
    result = latency.run(implementations="full,linearized,retained", lengths="16", batch=BATCH, decode_tokens=2,
                         repeats=1, model=tiny_hf_dir, memory_limit_bytes=1000, threads=1, out_dir=str(out),
                         progress=lines.append, retain=4, retain_score="key_norm")

    written = json.loads((out / "latency.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert written["prefill"] == "random stand-in" and written["protocol"]["batch"] == BATCH
    assert {"cpu_count", "jax", "torch", "transformers"} <= set(written["machine"])
    full, linear, retained = written["points"]
    assert (full["impl"], full["status"], linear["impl"], linear["status"]) == (
        "full", "did not fit", "linearized", "ok")
    assert (retained["impl"], retained["status"], retained["name"]) == (
        "retained", "ok", "linjax linearized + 4 retained by key_norm (GDN + w56 + s8 + short conv)")
    assert retained["state_bytes"] > linear["state_bytes"] and written["retention"] == {"retain": 4,
                                                                                          "retain_score": "key_norm"}
    assert set(written["cache_bytes_per_layer"]) == {"full", "linearized", "retained"}
    assert full["reason"].startswith("not started: the KV cache alone needs")
    assert linear["decode_s"] > 0 and linear["ms_per_token"] == pytest.approx(1000 * linear["decode_s"] / 2)
    assert linear["peak_rss_bytes"] >= linear["baseline_rss_bytes"] > 0 and linear["state_bytes"] > 0
    assert linear["prefill"] == "random stand-in" and len(linear["decode_s_runs"]) == 1

    table = (out / "latency.md").read_text()
    assert "| L | full: 2 steps (s) | full: peak / state (GiB) | linearized: 2 steps (s) |" in table
    assert "| 16 | did not fit | did not fit |" in table and "random stand-in" in table
    assert "Decode cache per layer (KiB)" in table
    assert "- `retained`: linjax linearized + 4 retained by key_norm" in table
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [name for name in os.listdir(out) if name.startswith(".point-")]
    assert any("did not fit" in line for line in lines)


def test_longer_lengths_are_skipped_once_a_point_did_not_fit(tiny_hf_dir, tmp_path):
    result = latency.run(implementations="full", lengths="16,32", batch=BATCH, decode_tokens=2, repeats=1,
                         model=tiny_hf_dir, memory_limit_bytes=1, out_dir=str(tmp_path), progress=lambda _: None)
    assert [(p["status"], p["reason"].split(":")[0]) for p in result["points"]] == [
        ("did not fit", "not started"), ("skipped", "L=16 did not complete (did not fit)")]


def test_summary_and_table_compare_at_the_largest_length_both_finished():
    def point(impl, L, seconds, gib, status="ok"):
        return {"impl": impl, "name": latency.IMPLEMENTATIONS[impl], "L": L, "status": status,
                "decode_s": seconds, "peak_rss_bytes": int(gib * latency.GIB), "state_bytes": latency.GIB // 4}

    result = {"model": "m", "prefill": "random stand-in", "prefill_note": "n", "lengths": [1024, 2048, 4096],
              "implementations": {k: latency.IMPLEMENTATIONS[k] for k in ("full", "linearized", "transformers")},
              "protocol": {"batch": 8, "decode_tokens": 16, "repeats": 3, "threads": 2},
              "machine": {"cpu_count": 2, "jax": "x", "torch": "y", "transformers": "z"},
              "points": [point("full", 1024, 2.0, 2.0), point("linearized", 1024, 1.0, 1.0),
                         point("transformers", 1024, 3.0, 2.5), point("full", 2048, 4.0, 3.0),
                         point("linearized", 2048, 1.0, 1.05), point("transformers", 2048, 0, 0, "did not fit"),
                         point("full", 4096, 0, 0, "did not fit"), point("linearized", 4096, 1.0, 1.08),
                         point("transformers", 4096, 0, 0, "skipped")]}
    summary = latency.summarize(result)
    assert [(r["versus"], r["L"], r["speedup"]) for r in summary["ratios"]] == [
        ("full", 2048, 4.0), ("transformers", 1024, 3.0)]
    change = summary["linearized_memory_change"]
    assert (change["from_L"], change["to_L"], change["flat_within_10_percent"]) == (1024, 4096, True)
    assert change["percent"] == pytest.approx(8.0, abs=0.01)
    table = latency.markdown(dict(result, summary=summary))
    assert "| 2,048 | 4.000 | 3.00 / 0.25 | 1.000 | 1.05 / 0.25 | did not fit | did not fit | 4.00× | – |" in table
    assert "At L = 2,048, the largest both finished: linearized decodes 4.00× as fast as `full`" in table
    assert "+8.0% (flat within 10%)" in table


def test_a_process_that_ended_without_a_result_is_classified():
    assert latency.failed_point(-9, "")["status"] == "did not fit"
    assert latency.failed_point(1, "jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory")["status"] == \
        "did not fit"
    error = latency.failed_point(1, "Traceback ...\nKeyError: 'x'")
    assert error["status"] == "error" and "KeyError" in error["reason"]


@pytest.mark.parametrize("kwargs, message", [
    ({"lengths": "0,1024"}, "positive integers"),
    ({"lengths": "1k"}, "positive integers"),
    ({"implementations": "full,flash"}, "unknown implementation"),
    ({"batch": 0}, "batch must be"),
    ({"threads": 10_000}, "threads must be"),
])
def test_bad_input_is_refused_with_a_clear_error(tiny_hf_dir, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        latency.run(**{"model": tiny_hf_dir, "out_dir": str(tmp_path), **kwargs})


def test_cli_and_bench_script_share_the_options():
    args = build_parser().parse_args(["bench", "latency", "--lengths", "16,32", "--real-prefill", "--out", "x"])
    assert (args.lengths, args.real_prefill, args.batch, args.decode_tokens, args.out) == ([16, 32], True, 8, 16, "x")
    assert args.func.__name__ == "_bench_latency"


@pytest.fixture(scope="module")
def tiny_config_dict(tiny_hf_dir):
    with open(os.path.join(tiny_hf_dir, "config.json")) as f:
        return json.load(f)


def test_cache_bytes_per_layer_are_fixed_in_the_context_with_and_without_retained_tokens(tiny_config_dict):
    """From shapes only: a linear layer's cache is the same at 100 and 100,000 tokens, retained slots
    included, and a KV cache grows in proportion to the tokens."""
    short, long = 100, 100_000
    for impl in ("linearized", "retained"):
        sizes = cache_bytes_per_layer(tiny_config_dict, impl, 1, short, retain=8)
        assert len(sizes) == tiny_config_dict["num_hidden_layers"] and min(sizes) > 0
        assert cache_bytes_per_layer(tiny_config_dict, impl, 1, long, retain=8) == sizes
    linear = cache_bytes_per_layer(tiny_config_dict, "linearized", 1, short)
    retained = [cache_bytes_per_layer(tiny_config_dict, "retained", 1, short, retain=r) for r in (8, 16)]
    assert all(a < b < c for a, b, c in zip(linear, *retained))  # the slots cost memory, in proportion to R
    assert [b - a for a, b in zip(linear, retained[0])] == [c - b for b, c in zip(*retained)]
    layers = tiny_config_dict["num_hidden_layers"]
    full = [cache_bytes_per_layer(tiny_config_dict, "full", 1, n) for n in (short, long)]
    assert [sum(f) for f in full] == [kv_cache_bytes(tiny_config_dict, 1, n) + 4 * layers for n in (short, long)]

    table = latency.cache_table(tiny_config_dict, ["full", "retained", "transformers"], [16, 64], 2,
                                {"retain": 8, "retain_score": "recall"})
    assert list(table) == ["full", "retained"] and table["retained"]["16"] == table["retained"]["64"]
    result = {"lengths": [16, 64], "protocol": {"decode_tokens": 2}, "cache_bytes_per_layer": table}
    text = "\n".join(latency.cache_lines(result))
    assert "- `retained`: fixed in L" in text and "- `full`: grows in L" in text


def test_retention_options_reach_the_retained_implementation_only(tiny_hf_dir, tmp_path, capsys):
    args = build_parser().parse_args(["bench", "latency", "--implementations", "linearized,retained",
                                      "--retain", "32", "--retain-score", "key_norm"])
    assert (args.implementations, args.retain, args.retain_score) == (["linearized", "retained"], 32, "key_norm")
    args = build_parser().parse_args(["bench", "latency"])
    assert (args.implementations, args.retain, args.retain_score) == (
        ["full", "linearized", "transformers"], None, None)
    for bad in (["--retain", "0"], ["--retain-score", "mass"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["bench", "latency", *bad])
        assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:  # retention settings without the implementation they set
        main(["bench", "latency", "--implementations", "full,linearized", "--retain", "64", "--model", tiny_hf_dir,
              "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "add it to --implementations" in capsys.readouterr().err
    assert latency.retention_settings(["retained"], None, None) == {"retain": 64, "retain_score": "recall"}
    assert latency.retention_settings(["full"], None, None) is None
    assert "64 retained by recall" in latency.implementation_label("retained")
    assert "16 retained by key_norm" in latency.implementation_label("retained", 16, "key_norm")
