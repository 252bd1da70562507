"""Argument helpers shared by the command modules (``cli``, ``tune_cmd``, ``plan_cmd``,
``export_cmd``): the parser class, the usage error, and the value parsers.

This module imports nothing else from rtcompile, so every command module can import it and
none needs another: the command modules form no import cycle.
"""

from __future__ import annotations

import argparse
import os

EXIT_USAGE = 2


class UsageError(Exception):
    """A command-line usage error: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as :class:`UsageError` (one line, no usage block)."""

    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        raise UsageError(f"{self.prog}: {message}")


def int_at_least(lo: int):
    """A parser of integers >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def number_list_of(kind: type, minimum: float | None, what: str):
    """An argparse type: comma-separated ``kind`` values (int or float) >= ``minimum`` (None: any;
    ``what`` names them in the error)."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values or (minimum is not None and any(v < minimum for v in values)):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    return parse


def int_list_of(minimum: int, what: str):
    """An argparse type: comma-separated integers >= ``minimum`` (``what`` names them in the error)."""
    return number_list_of(int, minimum, what)


int_list = int_list_of(1, "positive integers")  # ``8,32``


def positive_int(text: str) -> int:
    v = int_list(text)
    if len(v) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return v[0]


def fixed_param(text: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as an integer, true/false, or kept as text."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip() or not raw.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    raw = raw.strip()
    value: object = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif raw.lstrip("-").isdigit():
        value = int(raw)
    return name.strip(), value


def check_out_dir(prog: str, out: str | os.PathLike) -> None:
    """``--out DIR`` before any work (minutes of measuring, not after): created with its parents
    when missing, and writable; else a :class:`UsageError` naming ``prog``'s option."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{prog}: --out {str(out)!r}: cannot create ({exc.strerror})") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"{prog}: --out {str(out)!r}: not writable")


def check_out_file(prog: str, out: str | os.PathLike) -> None:
    """``--out FILE`` before any work: not a folder, its folder created when missing (as an
    ``--out DIR`` is) and writable; the file itself is written atomically later."""
    if os.path.isdir(out):
        raise UsageError(f"{prog}: --out {str(out)!r}: is a folder; allowed: a file path")
    check_out_dir(prog, os.path.dirname(os.path.abspath(out)))
