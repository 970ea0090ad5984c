"""Approximation error, assumption diagnostics and hybrid layer selection (paper's appendix)."""

import json

import numpy as np
import pytest
from flax import nnx

import linjax
from linjax.app.cli import main
from linjax.config import tiny_config
from linjax.eval import approx, diagnostics, select_layers
from linjax.mixers.softmax import SoftmaxAttention
from linjax.model import CausalLM
from tests.helpers import require_module


def brute_force_c_and_r(keys, eps=1e-6):
    """The appendix formulas, one (t, i) at a time, for keys [T, D]."""
    k = keys / (np.linalg.norm(keys, axis=-1, keepdims=True) + eps)
    c, r = [], []
    for t in range(1, len(k) + 1):
        mean = k[:t].mean(0)
        c.append(k[t - 1] @ mean / (np.linalg.norm(k[t - 1]) * np.linalg.norm(mean) + eps))
        projection = np.outer(mean, mean) / (mean @ mean + eps)
        r.append(np.mean([np.linalg.norm((k[i] - mean) - (np.eye(len(mean)) - projection) @ k[i]) for i in range(t)]))
    return np.array(c), np.array(r)


def test_concentration_and_residual_match_the_appendix_formulas():
    rng = np.random.default_rng(0)
    # A dominant direction plus noise, as real keys have; two heads.
    keys = rng.standard_normal((2, 40, 16)) * 0.6 + rng.standard_normal((2, 1, 16))
    c, r = (np.asarray(a) for a in diagnostics.concentration_and_residual(keys))
    for h in range(2):
        want_c, want_r = brute_force_c_and_r(keys[h])
        np.testing.assert_allclose(c[h], want_c, atol=2e-5)
        np.testing.assert_allclose(r[h], want_r, atol=2e-5)
    assert c[0, 0] == pytest.approx(1.0, abs=1e-5) and r[0, 0] == pytest.approx(0.0, abs=1e-5)  # one key: its own mean


def test_mse_and_nmse_match_numpy():
    rng = np.random.default_rng(1)
    full, lin = rng.standard_normal((2, 30, 8)) * 3, rng.standard_normal((2, 30, 8))
    mse, nmse = approx.mse_and_nmse(full, lin)
    assert mse == pytest.approx(((full - lin) ** 2).sum() / full.size)
    assert nmse == pytest.approx(mse / full.var())
    assert approx.mse_and_nmse(full, full) == (0.0, 0.0)


@pytest.fixture(scope="module")
def base():
    return CausalLM(tiny_config("llama", num_hidden_layers=4), rngs=nnx.Rngs(0))


def teacher_attention_in_torch(base, tokens, tmp_path):
    """(h, y) [layers, B, T, d]: each layer's attention input (after input_layernorm) and output (after
    o_proj) in the teacher, from transformers' own Llama through forward hooks, not from linjax."""
    torch = require_module("torch")
    from transformers import AutoModelForCausalLM

    linjax.save_hf(base, str(tmp_path / "teacher"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "teacher"), attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    h, y = [], []
    for layer in model.model.layers:
        layer.input_layernorm.register_forward_hook(lambda m, args, out: h.append(out.numpy()))
        layer.self_attn.register_forward_hook(lambda m, args, out: y.append(out[0].numpy()))
    with torch.no_grad():
        model(torch.from_numpy(tokens.astype(np.int64)))
    return np.stack(h), np.stack(y)


def test_model_error_is_zero_where_exact_and_matches_a_direct_computation(base, tmp_path):
    tokens = np.random.default_rng(2).integers(0, base.config.vocab_size, (2, 24)).astype(np.int32)
    student = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0), seed=0)
    result = approx.approximation_error(base, student, tokens)
    assert [r["layer"] for r in result["per_layer"]] == [0, 1, 2, 3]
    # Independently: the teacher's layer inputs and outputs from transformers, the student's attention
    # on those inputs, and the appendix formulas in numpy (pooled over both sequences).
    h, full = teacher_attention_in_torch(base, tokens, tmp_path)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    lin = np.stack([np.asarray(student.layers[i].attn(h[i], positions)) for i in range(4)])
    full, lin = full.astype(np.float64), lin.astype(np.float64)  # [L, B, T, d]
    mse = ((full - lin) ** 2).mean(axis=(1, 2, 3))  # 1/(T d) ‖y_full − y_lin‖², averaged over sequences
    variance = full.var(axis=(1, 2, 3))  # Var(y_full) over every sequence, token and channel
    for i, row in enumerate(result["per_layer"]):
        assert row["mse"] == pytest.approx(mse[i], rel=1e-4) and row["nmse"] == pytest.approx(mse[i] / variance[i],
                                                                                              rel=1e-4)
    per_token = (((full - lin) ** 2).mean(axis=(1, 3)) / variance[:, None]).mean(0)  # [T]: over sequences, d, layers
    np.testing.assert_allclose(result["per_token"]["nmse"], per_token, rtol=1e-4)
    assert len(result["per_token"]["nmse"]) == 24 and min(result["per_token"]["nmse"]) > 0
    hybrid = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0,
                                                           keep_full_attention=(0, 1, 2)), seed=0)
    hybrid.layers[3].attn = base.layers[3].attn  # the one linear layer replaced by the original attention
    with pytest.raises(ValueError, match="no linearized layer"):
        approx.approximation_error(base, hybrid, tokens)
    other = CausalLM(tiny_config("llama", num_hidden_layers=4), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="not a linearization"):
        approx.approximation_error(other, student, tokens)
    with pytest.raises(ValueError, match="original full-attention"):
        approx.approximation_error(student, student, tokens)


def test_student_identical_to_the_teacher_has_zero_nmse(base):
    """A window as long as the sequence and no sinks: the linear state holds nothing yet and the
    window softmax is the full softmax, so every linearized layer reproduces the teacher."""
    tokens = np.random.default_rng(3).integers(0, base.config.vocab_size, (2, 16)).astype(np.int32)
    student = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gla", window=16, sinks=0), seed=0)
    result = approx.approximation_error(base, student, tokens)
    assert max(r["nmse"] for r in result["per_layer"]) < 1e-10
    assert max(result["per_token"]["nmse"]) < 1e-10


def test_select_layers():
    assert select_layers.keep_count(30, 0.2) == 6 and select_layers.keep_count(30, 4) == 4
    assert select_layers.uniform(30, 6) == [2, 7, 12, 17, 22, 27]
    assert np.ptp(np.diff(select_layers.uniform(32, 4))) == 0
    scores = {i: float(s) for i, s in enumerate(np.random.default_rng(4).permutation(20))}
    hard_high = select_layers.hardest(scores, 5, "high")
    assert sorted(hard_high) == sorted(i for i, s in scores.items() if s >= 15)
    hard_low = select_layers.hardest(scores, 3, "low")
    assert sorted(hard_low) == sorted(i for i, s in scores.items() if s < 3)
    for bad in (0, 1.5, 31):
        with pytest.raises(ValueError, match="--keep"):
            select_layers.keep_count(30, bad)
    for n, keep, want in ((32, 0.1, 3), (32, 0.5, 16), (30, 0.2, 6), (4, 0.2, 1), (12, 3, 3)):
        chosen = select_layers.select(n, keep, "uniform")
        assert len(chosen) == want and len(set(chosen)) == want and all(0 <= i < n for i in chosen)
    with pytest.raises(ValueError, match="--scores"):
        select_layers.select(30, 0.2, "residual")


def test_include_merges_fragments_before_set(tmp_path):
    from linjax.app.cli import build_parser
    from linjax.train import load_experiment

    experiment = tmp_path / "exp.toml"
    experiment.write_text(f'run_dir = "{tmp_path / "run"}"\n'
                          '[linearize]\nmechanism = "gdn"\nwindow = 8\n[train]\nsteps = 500\n')
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    select_layers.write_fragment([1, 2], str(first))
    second.write_text("[linearize]\nwindow = 16\n[train]\nlr = 0.5\n")
    config = load_experiment(str(experiment), ["linearize.window=32"], [str(first), str(second)])
    assert config.linearize.keep_full_attention == (1, 2) and config.linearize.mechanism == "gdn"
    assert config.linearize.window == 32 and config.train.lr == 0.5 and config.train.steps == 500
    for command in ("train", "run"):
        args = build_parser().parse_args([command, str(experiment), "--include", str(first), "--include", str(second)])
        assert args.include == [str(first), str(second)]


def test_cli_diagnostics_approx_and_a_fragment_train_accepts(tiny_source, tmp_path):
    data = tmp_path / "held_out.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Record {i}: keys concentrate, residuals shrink."})
                              for i in range(60)))
    experiment = tmp_path / "exp.toml"
    experiment.write_text(f'run_dir = "{tmp_path / "run"}"\n[model]\nsource = "{tiny_source}"\n'
                          f'[linearize]\nmechanism = "gdn"\nwindow = 4\nsinks = 1\n[data]\npaths = ["{data}"]\n')
    main(["eval", "diagnostics", tiny_source, "--student", str(experiment), "--data", str(data),
          "--num-seqs", "2", "--seq-len", "32", "--out", str(tmp_path / "diag")])
    diag = json.loads((tmp_path / "diag" / "diagnostics.json").read_text())
    layers, kv_heads = len(diag["per_layer"]), len(diag["per_layer_head_token"]["concentration"][0])
    assert len(diag["per_token"]["concentration"]) == 32
    assert layers == diag["num_layers"] == linjax.load(tiny_source)[0].config.num_hidden_layers
    assert sum(b["count"] for b in diag["binned_nmse"]["residual"]) == layers * kv_heads * 32
    assert all((tmp_path / "diag" / p).exists() for p in ("diagnostics_per_token.png", "diagnostics_binned_nmse.png"))
    main(["eval", "approx", tiny_source, str(experiment), "--data", str(data), "--num-seqs", "2",
          "--seq-len", "32", "--out", str(tmp_path / "approx")])
    assert (tmp_path / "approx" / "approx_per_token.png").exists()
    fragment = tmp_path / "keep.toml"
    main(["eval", "select-layers", "--keep", "1", "--by", "residual",  # layer count read from the JSON
          "--scores", str(tmp_path / "diag" / "diagnostics.json"), "--out", str(fragment)])
    hardest = max(diag["per_layer"], key=lambda r: r["residual"])["layer"]
    from linjax.train import load_experiment

    config = load_experiment(str(experiment), [], [str(fragment)])
    assert config.linearize.keep_full_attention == (hardest,)
    assert config.linearize.window == 4  # the rest of the section is kept
    hybrid = linjax.linearize(linjax.load(tiny_source)[0], config.linearize, seed=0)
    assert [isinstance(b.attn, SoftmaxAttention) for b in hybrid.layers] == [i == hardest for i in range(layers)]
