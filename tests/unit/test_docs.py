"""The docs stay true: every CLI option is in docs/cli.md, every module in docs/structure.md."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _all_parsers():
    from lightwell.cli import _register_extra, build_parser
    from scripts.gen_cli_docs import subparsers

    _register_extra()
    top = build_parser()
    out = [("lightwell", top)]
    for name, sub in subparsers(top):
        out.append((name, sub))
        out += [(f"{name} {n}", s) for n, s in subparsers(sub)]
    return out


def test_every_cli_option_is_documented():
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = [
        f"{name}: {opt}"
        for name, parser in _all_parsers()
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt not in text
    ]
    assert not missing, "run `python scripts/gen_cli_docs.py`; missing:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "module",
    sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "lightwell").rglob("*.py")
        if p.name != "__init__.py"
    ),
)
def test_module_listed_in_structure_doc(module):
    assert module in (ROOT / "docs" / "structure.md").read_text(), f"{module} not in structure.md"


def test_every_environment_variable_is_documented():
    """lightwell/envs.py is the one module that reads the environment; docs/structure.md lists
    every variable it declares, and no other module of the package names a LIGHTWELL_ one."""
    from lightwell import envs

    text = (ROOT / "docs" / "structure.md").read_text()
    assert [v for v in envs.VARIABLES if f"`{v}`" not in text] == []
    others = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "lightwell").rglob("*.py")
        if p.name != "envs.py"
        and ("LIGHTWELL_" in p.read_text() or "os.environ.get" in p.read_text())
    ]
    assert others == []
