"""Hedgehog's feature map against FLA's `HedgehogFeatureMap`, the map the paper's appendix names.

FLA: z = x Wᵀ + b (nn.Linear, identity and zero at init), φ(x) = softmax([2z, −2z]).
`fla/modules/feature_map.py` imports triton-backed modules at the top (activations,
layernorm), so neither `import fla` nor loading that file works on a CPU machine. The
class itself uses only torch: the test takes its source out of FLA's file (ast) and
runs exactly that code, so the oracle is FLA's own, not a re-derivation. Both linjax's
map (JAX, weight in Flax's [in, out] layout) and the PyTorch mirror in the export
(convert/modeling_linjax.py, weight in nn.Linear's [out, in] layout as convert/export.py
writes it) are checked against it with the same random weight and bias.
"""

from __future__ import annotations

import ast
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import relative_rms
from tests.kernels.fla_oracle import missing

HEAD_DIM = 16


def fla_hedgehog_class():
    """FLA's HedgehogFeatureMap class, compiled from fla/modules/feature_map.py without importing fla."""
    if importlib.util.find_spec("torch") is None:
        missing("torch is not installed (pip install -e '.[test]') - FLA oracle tests skipped")
    spec = importlib.util.find_spec("fla")  # finds the package without importing it (which needs triton)
    if spec is None or not spec.submodule_search_locations:
        missing("fla-core is not installed (pip install fla-core==0.6.0) - FLA oracle tests skipped")
    path = os.path.join(list(spec.submodule_search_locations)[0], "modules", "feature_map.py")
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "HedgehogFeatureMap"]
    if not found:
        missing(f"{path} has no HedgehogFeatureMap (the tests expect fla-core==0.6.0)")
    import torch
    from torch import nn

    namespace = {"torch": torch, "nn": nn, "__name__": "fla_hedgehog_oracle"}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return namespace["HedgehogFeatureMap"]


@pytest.fixture(scope="module")
def case():
    """FLA's map with a random weight and bias, and inputs [B, T, H, D] of attention-like size."""
    import torch

    fla_map = fla_hedgehog_class()(HEAD_DIM).double()
    rng = np.random.default_rng(0)
    # Far from the identity, so a transposed weight or a missing factor shows.
    weight = rng.normal(0, 0.5, (HEAD_DIM, HEAD_DIM))  # nn.Linear's [out, in]
    bias = rng.normal(0, 0.5, HEAD_DIM)
    with torch.no_grad():
        fla_map.layer.weight.copy_(torch.from_numpy(weight))
        fla_map.layer.bias.copy_(torch.from_numpy(bias))
    x = rng.normal(0, 2.0, (2, 5, 3, HEAD_DIM)).astype(np.float32)
    with torch.no_grad():
        expected = fla_map(torch.from_numpy(x).double()).numpy()
    return weight, bias, x, expected


def test_fla_map_is_identity_and_zero_at_init():
    """The init linjax copies: FLA's map starts as identity weight and zero bias."""
    fla_map = fla_hedgehog_class()(HEAD_DIM)
    np.testing.assert_array_equal(fla_map.layer.weight.detach().numpy(), np.eye(HEAD_DIM))
    np.testing.assert_array_equal(fla_map.layer.bias.detach().numpy(), np.zeros(HEAD_DIM))


def test_linjax_feature_map_matches_fla(case):
    from linjax.mixers.hedgehog import FeatureMap

    weight, bias, x, expected = case
    feature_map = FeatureMap(HEAD_DIM)
    np.testing.assert_array_equal(np.asarray(feature_map.weight[...]), np.eye(HEAD_DIM))  # FLA's init
    np.testing.assert_array_equal(np.asarray(feature_map.bias[...]), np.zeros(HEAD_DIM))
    feature_map.weight[...] = jnp.asarray(weight.T, jnp.float32)  # linjax computes x @ weight ([in, out])
    feature_map.bias[...] = jnp.asarray(bias, jnp.float32)
    got = np.asarray(feature_map(jnp.asarray(x)))
    assert got.shape == expected.shape == x.shape[:-1] + (2 * HEAD_DIM,)
    assert relative_rms(got, expected) <= 1e-6


def test_pytorch_mirror_feature_map_matches_fla(case):
    """The export's map, loaded with the tensors convert/export.py writes for linjax's map."""
    import torch

    from linjax.convert.export import _linear
    from linjax.convert.modeling_linjax import FeatureMap

    weight, bias, x, expected = case
    tensors = _linear("proj", jnp.asarray(weight.T, jnp.float32), jnp.asarray(bias, jnp.float32))
    mirror = FeatureMap(HEAD_DIM)
    mirror.load_state_dict({name: torch.from_numpy(array) for name, array in tensors.items()})
    with torch.no_grad():
        got = mirror(torch.from_numpy(x)).numpy()
    assert relative_rms(got, expected) <= 1e-6


@pytest.mark.parametrize("name,layers,paper_millions", [("llama-3.1-8b", 32, 10.6), ("qwen3-8b", 36, 11.9)])
def test_hedgehog_trainable_count_is_a_tenth_of_the_papers(name, layers, paper_millions):
    """One map for q and one for k per layer, each D × D + D (D = 128): the paper's appendix
    prints ten times this count (10.6M, 11.9M), as results/README.md says."""
    import linjax

    path = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs", f"{name}.json")
    count = linjax.trainable_parameter_count(linjax.abstract_model(path, linjax.LinearizeConfig(mechanism="hedgehog")))
    assert count == layers * 2 * (128 * 128 + 128)
    assert round(10 * count / 1e6, 1) == paper_millions
