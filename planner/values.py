"""What every input check uses: ConfigError and the tests of a JSON value."""
from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A bad model, cluster or plan input; the message names the field and the fix."""


def is_int(v) -> bool:
    """An integer that is not a bool (JSON true is not 1 here)."""
    return isinstance(v, int) and not isinstance(v, bool)


MAX_NAME = 200  # characters of a name that messages print (a model's, a profile's, a cluster's)


def is_one_line(v) -> bool:
    """A name messages can print: a non-empty printable string of one line, at most MAX_NAME long
    (a newline would start a second, forgeable, error line)."""
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable()


def is_real(v) -> bool:
    """A finite JSON number (not a bool, NaN or infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def checked(cls, d, where: str):
    """A model field's object (planner.rope.RopeScaling, planner.moe.MoESpec) from dict `d`: strict
    fields, then its own check(where); cls.OBJECT says what the object holds where `d` is no object."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: is {d!r}; expected null or an object with {cls.OBJECT}")
    spec = cls(**strict(cls, d, where))
    spec.check(where)
    return spec


def strict(cls, d, where):
    """Build dataclass `cls` from dict `d`, refusing unknown and missing fields by name."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field; {where} has {', '.join(names)}")
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d:
            raise ConfigError(f"{where}.{f.name}: missing required field")
    return d
