"""The mixer registry is the one list of mechanisms (docs/architecture.md, "What a new mechanism touches").

`linjax.linearize.MIXERS` finds each mechanism's class in linjax/mixers/; every other list of
mechanisms is read from it. These tests keep that true: the PyTorch mirror registers the same
mechanisms with the same FLA kernels, every kernel module has its four forms, each mechanism's
example inputs fit its kernel, the test grids hold every mechanism, and the files the
architecture document says a mechanism touches exist for every mechanism.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re

import jax
import pytest

import linjax.kernels
from linjax.linearize import LINEAR_MIXERS, MIXERS
from tests.helpers import ROOT, relative_rms

FORMS = ("reference", "chunked", "step", "pallas")
# What a new linear mechanism touches (docs/architecture.md); everything else reads the registry.
PLACES = ("kernels/<kernel>.py", "linjax/mixers/<name>.py", "convert/modeling_linjax_linear.py",
          "tests/kernels/test_<kernel>.py")
WINDOW_KERNELS = {"swa"}  # the sinks + window softmax: four forms, no mechanism of its own


def mirror_mixers() -> dict:
    """The PyTorch mirror's registry (convert/modeling_linjax_attention.py), every class imported."""
    from linjax.convert import modeling_linjax, modeling_linjax_attention

    del modeling_linjax  # imported for its side effect: the mechanisms register themselves
    return modeling_linjax_attention.MIXERS


def kernel_modules() -> dict:
    """{name: module} of every module in kernels/ that has a `reference` form."""
    found = {}
    for info in pkgutil.iter_modules(linjax.kernels.__path__):
        module = importlib.import_module(f"linjax.kernels.{info.name}")
        if callable(getattr(module, "reference", None)):
            found[info.name] = module
    return found


def test_the_pytorch_mirror_registers_the_same_mechanisms():
    from linjax.convert.modeling_linjax_linear import LinearAttention

    mirror = mirror_mixers()
    assert sorted(mirror) == sorted(MIXERS), "linjax/mixers/ and convert/modeling_linjax*.py name other mechanisms"
    for name, mixer in LINEAR_MIXERS.items():
        theirs = mirror[name]
        assert issubclass(theirs, LinearAttention), f"the mirror's {name} is not a LinearAttention"
        for attribute in ("fla_kernel", "normalized", "linear_scale"):
            assert getattr(theirs, attribute) == getattr(mixer, attribute), \
                f"{name}.{attribute}: JAX {getattr(mixer, attribute)!r}, PyTorch {getattr(theirs, attribute)!r}"
    linear_in_mirror = {name for name, cls in mirror.items() if issubclass(cls, LinearAttention)}
    assert linear_in_mirror == set(LINEAR_MIXERS)


def test_every_kernel_module_has_its_four_forms_and_a_user():
    modules = kernel_modules()
    used = {mixer.kernel_module.__name__.rsplit(".", 1)[-1] for mixer in LINEAR_MIXERS.values()}
    assert used <= set(modules), f"mixers use kernel modules without a reference: {sorted(used - set(modules))}"
    for name, module in modules.items():
        missing = [form for form in FORMS if not callable(getattr(module, form, None))]
        assert not missing, f"kernels/{name}.py lacks {missing} (docs/architecture.md, 'Kernel contract')"
        first = [list(inspect.signature(getattr(module, form)).parameters)[:3] for form in FORMS]
        assert all(p == ["q", "k", "v"] for p in first), f"kernels/{name}.py: every form starts (q, k, v): {first}"
    unused = set(modules) - used - WINDOW_KERNELS
    assert not unused, f"kernel modules no mechanism uses (add its mixer to linjax/mixers/): {sorted(unused)}"


@pytest.mark.parametrize("mechanism", list(LINEAR_MIXERS))
def test_example_inputs_fit_the_mechanisms_kernel(mechanism):
    """What tests and benchmarks build from the registry: `example_inputs` run through the kernel's
    reference and chunked forms (GQA, T not a multiple of the chunk) and agree."""
    mixer = LINEAR_MIXERS[mechanism]
    inputs = mixer.example_inputs(jax.random.key(0), batch=1, time=21, heads=4, kv_heads=2, head_dim=8)
    q, k, v, *gates = inputs
    assert q.shape[:3] == (1, 21, 4) and k.shape[:3] == (1, 21, 2) and v.shape == (1, 21, 2, 8)
    assert all(g.shape[:3] == (1, 21, 4) for g in gates)
    want, want_state = mixer.kernel_module.reference(*inputs)
    got, got_state = mixer.kernel_module.chunked(*inputs, chunk=8)
    assert relative_rms(jax.tree.leaves(got)[0], jax.tree.leaves(want)[0]) <= 1e-5
    assert relative_rms(got_state, want_state) <= 1e-5


def test_every_mechanism_is_in_every_grid():
    """The mechanism grids of the library's tests are the registry, not lists written by hand."""
    from tests import test_export, test_linearize

    grids = {"tests/test_export.py MECHANISMS": test_export.MECHANISMS,
             "tests/test_linearize.py MECHANISMS": test_linearize.MECHANISMS}
    for where, grid in grids.items():
        assert tuple(grid) == tuple(LINEAR_MIXERS), f"{where} is {grid}, the registry {tuple(LINEAR_MIXERS)}"


def test_the_places_a_new_mechanism_touches_exist_for_every_mechanism():
    """docs/architecture.md and the README's contributing section list the files a new mechanism
    touches; each exists for every mechanism in the registry, and both documents name each place
    (so the list and the code cannot drift apart)."""
    sections = {"docs/architecture.md": "## What a new mechanism touches", "README.md": "## Contributing"}
    for path, heading in sections.items():
        with open(os.path.join(ROOT, path)) as f:
            section = f.read().split(heading, 1)[1].split("\n## ", 1)[0]
        for place in PLACES:
            assert place in section, f"{path} ({heading}) no longer names {place}"
    with open(os.path.join(ROOT, "convert", "modeling_linjax_linear.py")) as f:
        mirror = f.read()
    for name, mixer in LINEAR_MIXERS.items():
        kernel = mixer.kernel_module.__name__.rsplit(".", 1)[-1]
        module_file = inspect.getsourcefile(mixer)
        assert os.path.dirname(module_file) == os.path.join(ROOT, "linjax", "mixers"), module_file
        for path in (f"kernels/{kernel}.py", f"tests/kernels/test_{kernel}.py"):
            assert os.path.exists(os.path.join(ROOT, path)), f"{name}: {path} is missing"
        assert re.search(rf'^\s+mechanism = "{name}"$', mirror, re.M), \
            f"{name}: no class in convert/modeling_linjax_linear.py names mechanism = {name!r}"
