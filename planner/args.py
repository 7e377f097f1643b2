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


def int_list(low: int = 1, high: int | None = None):
    """A parser of comma-separated integers (at least `low`, at most `high`) to a sorted tuple."""
    def parse(text: str) -> tuple:
        vals = []
        for part in text.split(","):
            try:
                v = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers "
                                                 f"such as 1,2,4") from None
            if v < low or (high is not None and v > high):
                bound = f"from {low} to {high}" if high is not None else f"at least {low}"
                raise argparse.ArgumentTypeError(f"{v} must be {bound}")
            vals.append(v)
        return tuple(sorted(set(vals)))
    return parse


def choice_list(choices):
    """A parser of comma-separated names among `choices` to a tuple in the order of `choices`."""
    def parse(text: str) -> tuple:
        got = [part.strip() for part in text.split(",")]
        bad = [g for g in got if g not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)} "
                                             f"(give one or several, comma-separated)")
        return tuple(c for c in choices if c in got)
    return parse
