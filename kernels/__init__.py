"""Linear-attention kernels: pure JAX functions (reference, chunked, step, pallas), installed as linjax.kernels.

Where the repository root is on sys.path (`python -m pytest`, `python -c` or a script run from the root),
this folder also answers to the top-level name `kernels`, which is Hugging Face's kernel-hub package:
transformers (5.25 and later) depends on it and imports it at load. Imported under that name, this
module hands the name over to the installed package; linjax itself imports only `linjax.kernels`.
"""

import os
import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util

    _root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns once this module has run
        _spec.loader.exec_module(_module)
