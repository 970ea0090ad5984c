"""argparse types for linjax's command lines: numbers and lists checked as they are parsed.

argparse reports an ArgumentTypeError as `argument --seq-len: must be ...`, with the usage and status 2.
"""

from __future__ import annotations

import argparse


def _number(kind, text: str, minimum, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not value >= minimum:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(int, text, 0, "an integer ≥ 0")


def positive_float(text: str) -> float:
    value = _number(float, text, 0.0, "a positive number")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text, 0.0, "a number ≥ 0")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text!r}")
    return value


def names_list(text: str) -> list[str]:
    """'piqa, arc_easy' → ['piqa', 'arc_easy']; at least one name."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated names like 'a,b', got {text!r}")
    return names


def positive_ints(text: str) -> list[int]:
    """'1024,2048' → [1024, 2048]; at least one, each a positive integer."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = [int(x) for x in items]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers like '1024,2048', "
                                         f"got {text!r}")
    return values


def optional_positive_ints(text: str) -> list[int]:
    """Like `positive_ints`, but '' (the default: none) is an empty list."""
    return positive_ints(text) if text.strip() else []


def argument_type(parse):
    """An argparse type from a parser whose ValueError message is written for people."""
    def parse_argument(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse_argument.__name__ = parse.__name__
    return parse_argument
