"""ARCHITECTURE.md's import boundaries, checked on the source (static imports, any depth).

Every package and top-level module of ``lightwell`` has a rule: the layers it must never
import. The control plane (server -> engine -> scheduler -> kvcache) has no torch; the data
plane goes executor -> worker -> models -> layers / attention / quant -> kernels; the leaves
(config, types, envs, progress, model_files, storage) import nothing of Lightwell's but themselves
(model_files and storage: each other, pure Python). Triton kernels are imported where a CUDA
path launches them, never when a module loads (the CPU path runs without Triton).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "lightwell"

# the data plane, bottom up: a package never imports one above it
_ABOVE_KERNELS = [
    "lightwell.attention", "lightwell.layers", "lightwell.quant", "lightwell.models",
    "lightwell.dual_stream", "lightwell.distributed", "lightwell.worker", "lightwell.executor",
]  # fmt: skip
_CONTROL = ["lightwell.engine", "lightwell.scheduler", "lightwell.server", "lightwell.cli"]
_RUNTIME = ["lightwell.worker", "lightwell.executor", *_CONTROL]

# package -> module prefixes it must never import (directly, at any nesting level)
FORBIDDEN = {
    "kvcache": ["torch", "lightwell.scheduler", "lightwell.engine", "lightwell.worker"],
    "scheduler": ["torch", "lightwell.engine", "lightwell.worker", "lightwell.models"],
    "engine": [
        "torch",
        "lightwell.worker",
        "lightwell.layers",
        "lightwell.server",
        "lightwell.models",
        "lightwell.distributed",
        "lightwell.kernels",
        "lightwell.attention",
    ],  # fmt: skip
    "executor": [
        "lightwell.engine",
        "lightwell.server",
        "lightwell.models",
        "lightwell.layers",
        "lightwell.distributed",
        "lightwell.kernels",
        "lightwell.attention",
    ],  # fmt: skip
    "worker": ["lightwell.engine", "lightwell.scheduler.scheduler", "lightwell.server"],
    "dual_stream": ["lightwell.worker", "lightwell.executor", *_CONTROL],
    "models": ["lightwell.dual_stream", *_RUNTIME],
    "layers": ["lightwell.models", "lightwell.dual_stream", *_RUNTIME],
    "attention": ["lightwell.models", "lightwell.layers", "lightwell.dual_stream", *_RUNTIME],
    "quant": ["lightwell.models", "lightwell.dual_stream", *_RUNTIME],
    "kernels": _ABOVE_KERNELS + _CONTROL,
    "distributed": ["lightwell.models", "lightwell.layers", "lightwell.dual_stream", *_RUNTIME],
    "experimental": ["lightwell.worker", "lightwell.executor", *_CONTROL],
    "server": ["lightwell.worker", "lightwell.models", "lightwell.layers", "lightwell.kernels"],
    "bench": ["lightwell.worker", "lightwell.models", "lightwell.layers", "lightwell.kernels"],
    "types": ["torch", "lightwell"],
    "config": ["torch", "lightwell"],
    "envs": ["torch", "lightwell"],
    "progress": ["torch", "lightwell"],
    "model_files": ["torch", "lightwell"],
    "file_checks": ["torch", "lightwell"],
    "preflight": ["lightwell.worker", "lightwell.models", "lightwell.engine", "lightwell.server"],
    "storage": ["torch", "lightwell"],
    "structured": [
        "torch",
        "lightwell.worker",
        "lightwell.models",
        "lightwell.engine",
        "lightwell.server",
    ],
    "cli": ["lightwell.worker", "lightwell.models", "lightwell.layers", "lightwell.kernels"],
    "cli_args": ["torch", "lightwell.worker", "lightwell.models", "lightwell.engine"],
}
ALLOWED = {
    "types": ["lightwell.types"],
    "config": ["lightwell.config"],
    "envs": ["lightwell.envs"],
    "file_checks": ["lightwell.file_checks"],
    "model_files": ["lightwell.model_files", "lightwell.storage"],
    "storage": ["lightwell.storage", "lightwell.model_files"],
}
# nothing of the product imports the experimental package
PRODUCT = [p for p in FORBIDDEN if p != "experimental"]


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


def test_every_package_has_a_rule():
    here = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    here |= {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert here == set(FORBIDDEN), f"packages without a rule: {sorted(here - set(FORBIDDEN))}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_import_boundaries(package):
    bad = []
    forbidden = FORBIDDEN[package] + (["lightwell.experimental"] if package in PRODUCT else [])
    for path in _files(package):
        for name in _imports(path):
            if any(name == a or name.startswith(a + ".") for a in ALLOWED.get(package, [])):
                continue
            for prefix in forbidden:
                if name == prefix or name.startswith(prefix + "."):
                    bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)


# Triton kernels load on the CUDA path only (the CPU image has no Triton): outside kernels/, no
# module imports one when it loads (inside the function that launches it instead), except these,
# which are themselves imported only when a CUDA path is chosen
CUDA_ONLY = ["lightwell.attention.triton_backend", "lightwell.quant.gguf_cuda"]
TRITON_FREE_KERNELS = [
    "lightwell.kernels.cpu",
    "lightwell.kernels.gguf_blocks",
    "lightwell.kernels.moe_gemv_rule",
]


def _load_time_imports(path: pathlib.Path) -> list[str]:
    """Imports that run when the module loads: not in a function, not under TYPE_CHECKING."""
    names, todo = [], list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return names


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_triton_loads_only_on_the_cuda_path():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        if _under(module, CUDA_ONLY) or (
            _under(module, ["lightwell.kernels"]) and not _under(module, TRITON_FREE_KERNELS)
        ):
            continue
        for name in _load_time_imports(path):
            triton_kernels = _under(name, ["lightwell.kernels"]) and not (
                _under(name, TRITON_FREE_KERNELS) or name == "lightwell.kernels"
            )
            if _under(name, ["triton", *CUDA_ONLY]) or triton_kernels:
                bad.append(f"{path.relative_to(ROOT.parent)} imports {name} when it loads")
    assert not bad, "\n".join(bad)
