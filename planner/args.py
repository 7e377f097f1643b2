"""Command-line parsing shared by trident's commands: errors in one line, value checks as types."""
from __future__ import annotations

import argparse
import math

MAX_ARG = 2 ** 31 - 1  # counts, sizes and lengths given on the command line

class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, the option, what is wrong, and where the
    usage is, without the usage block (subcommand parsers inherit the class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _int_from(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} must be at least {low}")
    if v > MAX_ARG:
        raise argparse.ArgumentTypeError(f"{v} is out of range: at most {MAX_ARG}")
    return v


def positive_int(text: str) -> int:
    return _int_from(text, 1)


def non_negative_int(text: str) -> int:
    return _int_from(text, 0)


def _finite(text: str, ok, what: str) -> float:
    """A finite number for which ok(v) holds; else a one-line error ending in `what`."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and ok(v)):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number{what}")
    return v


def positive_number(text: str) -> float:
    return _finite(text, lambda v: v > 0, " above 0")


def non_negative_number(text: str) -> float:
    return _finite(text, lambda v: v >= 0, ", 0 or more")


def probability(text: str) -> float:
    """A dropout probability: from 0 to below 1."""
    return _finite(text, lambda v: 0 <= v < 1, " from 0 to below 1")


def number_in(low: float, high: float, unit: str = ""):
    """A parser of a finite number from `low` to `high` (both included)."""
    def parse(text: str) -> float:
        return _finite(text, lambda v: low <= v <= high, f" from {low:g} to {high:g}{unit}")
    return parse


# --memory-limit: GiB a device, from about 1 MiB to about 1 EiB (in bytes, a finite float)
MEMORY_LIMIT_GIB = number_in(1e-3, 1e9, " GiB")


def nonempty(text: str) -> str:
    """A name or path option given as an empty string (`-o ""`), refused rather than ignored."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value; give a name or a path")
    return text


def profile_name(text: str) -> str:
    """A profile's --name: one printable line (profiles refuse others, planner.model_profile_checks)."""
    from planner.model import MAX_NAME, is_one_line
    if not (is_one_line(text) and text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: give a non-empty printable name of one line, at most {MAX_NAME} "
                                         "characters")
    return text


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
            if high is None and v > MAX_ARG:
                raise argparse.ArgumentTypeError(f"{v} is out of range: at most {MAX_ARG}")
            if v < low or (high is not None and v > high):
                bound = f"from {low} to {high}" if high is not None else f"at least {low}"
                raise argparse.ArgumentTypeError(f"{v} must be {bound}")
            vals.append(v)
        return tuple(sorted(set(vals)))
    return parse


def replica_list(text: str):
    """--dp-replicate: comma-separated HSDP replica counts (int_list), or 'all': every count valid
    for a configuration (planner.configs.allowed_replicas)."""
    return "all" if text.strip() == "all" else int_list()(text)


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
