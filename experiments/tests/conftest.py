"""The library's test settings and shared fixtures (tests/conftest.py) for the experiments' tests too."""

from tests.conftest import *  # noqa: F401,F403  (XLA flags, the compilation cache, the `tokenizer` fixture, ...)
