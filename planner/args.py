"""Command-line parsing shared by trident's commands: errors in one line, value checks as types."""
from __future__ import annotations

import argparse
import math


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, the option, what is wrong, and where the
    usage is, without the usage block (subcommand parsers inherit the class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def positive_number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return v
