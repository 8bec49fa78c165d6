"""ARCHITECTURE.md's import boundaries, checked on the source (static imports, any depth)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "lightwell"

# package -> module prefixes it must never import (directly, at any nesting level)
FORBIDDEN = {
    "kvcache": ["torch", "lightwell.scheduler", "lightwell.engine", "lightwell.worker"],
    "scheduler": ["torch", "lightwell.engine", "lightwell.worker", "lightwell.models"],
    "engine": ["torch", "lightwell.worker", "lightwell.layers", "lightwell.server"],
    "types": ["torch", "lightwell"],
    "config": ["torch", "lightwell"],
    "layers": ["lightwell.engine", "lightwell.scheduler", "lightwell.server", "lightwell.worker"],
    "kernels": ["lightwell.engine", "lightwell.scheduler", "lightwell.server", "lightwell.models"],
    "models": ["lightwell.engine", "lightwell.scheduler", "lightwell.server", "lightwell.worker"],
    "server": ["lightwell.worker", "lightwell.models.loader", "lightwell.layers"],
}
ALLOWED = {"types": ["lightwell.types"], "config": ["lightwell.config"]}


def _imports(path: pathlib.Path) -> list[str]:
    """Runtime imports: those under ``if TYPE_CHECKING:`` (annotations only) are left out."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for child in node.body for n in ast.walk(child)}
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(package: str) -> list[pathlib.Path]:
    single = ROOT / f"{package}.py"
    return [single] if single.exists() else sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_import_boundaries(package):
    bad = []
    for path in _files(package):
        for name in _imports(path):
            if any(name == a or name.startswith(a + ".") for a in ALLOWED.get(package, [])):
                continue
            for prefix in FORBIDDEN[package]:
                if name == prefix or name.startswith(prefix + "."):
                    bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)
