"""Switches read from environment variables, parsed as booleans the way people write them.

`LINJAX_ALLOW_CHANGED_INPUTS=false` must not mean "allowed": a switch is one of 1/true/yes/on or
0/false/no/off (any case, surrounding spaces ignored; unset or empty: the default), and anything
else is an error naming the variable, not a guess.

    LINJAX_ALLOW_CHANGED_INPUTS   go on although a run's inputs changed (linjax/fingerprint.py)
    LINJAX_COMPILATION_CACHE      the `linjax` command's XLA compilation cache (default on)
    LINJAX_HUGE_PAGES             transparent huge pages for XLA's buffers (default on)
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool = False, environ=None) -> bool:
    """The boolean environment variable `name` (`environ`: os.environ unless given); a ValueError
    naming it if it is set to anything but a boolean."""
    text = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not text:
        return default
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(f"environment variable {name}={text!r} is not a boolean; set it to one of "
                     f"{'/'.join(TRUE)} or {'/'.join(FALSE)}, or unset it")
