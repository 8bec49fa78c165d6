"""Every environment variable Lightwell reads, in one place.

Behaviour is configured through the typed config fields (``lightwell/config.py``, ``--help``),
never through the environment. What is read here is either provenance that changes no result
(``LIGHTWELL_COMMIT``) or another tool's own setting that Lightwell must respect (Triton's
interpreter, NCCL's peer-to-peer switch). Each is read when it is used, never at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type
    default: str
    meaning: str


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "LIGHTWELL_COMMIT",
            str,
            "",
            "The commit written into benchmark result files when the checkout has no .git "
            "(a tree copied to another machine); otherwise git's own is used.",
        ),
        EnvVar(
            "TRITON_INTERPRET",
            bool,
            "0",
            "Triton's own switch: 1 runs Triton kernels on the CPU through its interpreter "
            "(tests). The host-memory all-reduces run on CPU only then.",
        ),
        EnvVar(
            "NCCL_P2P_DISABLE",
            bool,
            "0",
            "NCCL's own switch: set (not 0), GPUs are treated as having no peer access, and "
            "the automatic all-reduce choice takes the path for PCIe boxes without P2P.",
        ),
        EnvVar(
            "XDG_CACHE_HOME",
            str,
            "",
            "The XDG base-directory convention: the CPU kernels compiled at first use are "
            "cached under $XDG_CACHE_HOME/lightwell/kernels (default ~/.cache/lightwell/kernels), "
            "tokenizers built from GGUF files under $XDG_CACHE_HOME/lightwell/tokenizers.",
        ),
    )
}


def get(name: str) -> str:
    """The value of registered variable ``name`` (its default when unset or empty)."""
    value = os.environ.get(name)
    return value if value else VARIABLES[name].default


def commit_override() -> str:
    return get("LIGHTWELL_COMMIT")


def triton_interpret() -> bool:
    return get("TRITON_INTERPRET") == "1"


def nccl_p2p_disabled() -> bool:
    return get("NCCL_P2P_DISABLE") != "0"


def cache_dir(sub: str) -> str:
    """Lightwell's cache folder ``sub`` (kernels, tokenizers) in the user's cache folder
    (XDG_CACHE_HOME, else ~/.cache)."""
    home = get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "lightwell", sub)
