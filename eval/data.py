"""Where evaluation data lives by default: `$LINJAX_DATA_DIR`, else ../shared/data
(beside a checkout of the project, where the project's public data sets are kept)."""

from __future__ import annotations

import os

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_dir() -> str | None:
    """The data folder, or None when there is none."""
    candidates = [os.environ.get("LINJAX_DATA_DIR"), os.path.join(os.getcwd(), "..", "shared", "data"),
                  os.path.join(_CHECKOUT, "..", "shared", "data")]
    for path in candidates:
        if path and os.path.isdir(path):
            return os.path.abspath(path)
    return None


def data_file(*parts: str) -> str | None:
    """A file of the data folder (e.g. data_file("wikitext", "...raw")), or None if it is absent."""
    root = data_dir()
    if root is None:
        return None
    path = os.path.join(root, *parts)
    return path if os.path.exists(path) else None
