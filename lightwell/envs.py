"""Every environment variable Lightwell reads, in one place.

Behaviour is configured through the typed config fields (``lightwell/config.py``, ``--help``),
never through the environment. What is left here are provenance and debug aids that change no
result; each is read when it is used (never at import time) through ``get``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type
    default: str | None
    meaning: str


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "LIGHTWELL_COMMIT",
            str,
            None,
            "The commit written into benchmark result files when the checkout has no .git "
            "(a tree copied to another machine); otherwise git's own is used.",
        ),
    )
}


def get(name: str) -> str | None:
    """The value of registered variable ``name`` (its default when unset or empty)."""
    var = VARIABLES[name]
    value = os.environ.get(name)
    return value if value else var.default
