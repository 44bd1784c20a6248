"""Deployment files: Kubernetes manifests against the API's own models, systemd units.

Every manifest is walked strictly against the `kubernetes` client's models (each key
must be a field of that model, each value of the field's type) and then deserialized
into them, which also enforces required fields. Then the wiring is checked: the pods
run `bamboo coordinator --bind ADDR:PORT` / `bamboo agent --join ADDR:PORT` with
`--token-file` inside the join-token secret's mount, agents reach the coordinator's
Service, sit on spot capacity with a drain hook, the coordinator avoids spot.
"""
from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO

k8s = pytest.importorskip("kubernetes.client", reason="the `kubernetes` test dependency")

KUBE = REPO / "deploy" / "kubernetes"
SYSTEMD = REPO / "deploy" / "systemd"
MODELS = {("v1", "Namespace"): "V1Namespace", ("v1", "Secret"): "V1Secret",
          ("v1", "Service"): "V1Service", ("apps/v1", "Deployment"): "V1Deployment",
          ("apps/v1", "StatefulSet"): "V1StatefulSet"}
NAMESPACE = "bamboo"
SPOT_LABELS = {"eks.amazonaws.com/capacityType": "SPOT", "cloud.google.com/gke-spot": "true",
               "kubernetes.azure.com/scalesetpriority": "spot"}


def _documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


DOCS = _documents()


def _by_kind(kind: str) -> list[dict]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _one(kind: str, name: str) -> dict:
    found = [d for d in _by_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# -- strict structural check against the client's models -----------------------------------


def _check(value: Any, type_name: str, where: str, errors: list[str]) -> None:
    # the client spells containers `List[X]` / `Dict[str, X]` (older: `list[X]` / `dict(str, X)`)
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list")
            return
        for i, item in enumerate(value):
            _check(item, type_name[5:-1], f"{where}[{i}]", errors)
        return
    if type_name.lower().startswith(("dict(", "dict[")):
        inner = type_name[len("dict(str, "):-1]
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a mapping")
            return
        for key, item in value.items():
            _check(item, inner, f"{where}.{key}", errors)
        return
    primitive = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
                 "datetime": (str,)}
    if type_name == "object":
        return  # IntOrString and free-form fields
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name]) and not (
            type_name in ("int", "float") and isinstance(value, bool))
        if not ok:
            errors.append(f"{where}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        errors.append(f"{where}: expected a {type_name} mapping")
        return
    json_to_attr = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in json_to_attr:
            errors.append(f"{where}: unknown field '{key}' for {type_name}")
            continue
        _check(item, model.openapi_types[json_to_attr[key]], f"{where}.{key}", errors)


@pytest.mark.parametrize("index", range(len(DOCS)),
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_manifest_matches_the_kubernetes_api(index: int) -> None:
    filename, doc = DOCS[index]
    model = MODELS.get((doc.get("apiVersion"), doc.get("kind")))
    assert model, f"{filename}: unexpected apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}"
    errors: list[str] = []
    _check(doc, model, f"{filename}:{doc['kind']}", errors)
    assert not errors, "\n".join(errors)
    # the client's own deserializer builds the objects, enforcing required fields
    obj = k8s.ApiClient()._ApiClient__deserialize(doc, model)
    assert type(obj).__name__ == model
    if doc["kind"] != "Namespace":
        assert doc["metadata"]["namespace"] == NAMESPACE
    assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bamboo"


def test_the_strict_check_catches_mistakes() -> None:
    errors: list[str] = []
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": "4", "selector": {}, "template": {"spec": {"containers": [
               {"name": "a", "comand": ["bamboo"]}]}}}}
    _check(bad, "V1Deployment", "d", errors)
    assert any("spec.replicas: expected int" in e for e in errors), errors
    assert any("unknown field 'comand'" in e for e in errors), errors
    missing_name = {"apiVersion": "v1", "kind": "Service", "metadata": {},
                    "spec": {"ports": [{"name": "x"}]}}  # a ServicePort needs its port
    with pytest.raises(Exception, match="port"):
        k8s.ApiClient()._ApiClient__deserialize(missing_name, "V1Service")


# -- wiring ---------------------------------------------------------------------------------


def _workload(kind: str, name: str) -> tuple[dict, dict]:
    obj = _one(kind, name)
    pod = obj["spec"]["template"]
    assert obj["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    return obj, pod["spec"]


def _container(pod: dict) -> dict:
    assert len(pod["containers"]) == 1
    return pod["containers"][0]


def _token_path(pod: dict) -> str:
    secret = _one("Secret", "bamboo-join-token")
    assert "token" in secret["stringData"]
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in _container(pod)["volumeMounts"] if m["name"] == volume["name"])
    assert mount.get("readOnly") is True
    item = next(i for i in volume["secret"]["items"] if i["key"] == "token")
    return f"{mount['mountPath']}/{item['path']}"


def _flag(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_coordinator_runs_on_demand_behind_its_service() -> None:
    sts, pod = _workload("StatefulSet", "bamboo-coordinator")
    assert sts["spec"]["replicas"] == 1
    command = _container(pod)["command"]
    assert command[:3] == ["bamboo", "coordinator", "--bind"]
    host, port = _flag(command, "--bind").rsplit(":", 1)
    assert host == "0.0.0.0" and _flag(command, "--token-file") == _token_path(pod)
    service = _one("Service", sts["spec"]["serviceName"])
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in _container(pod)["ports"]}
    (service_port,) = service["spec"]["ports"]
    assert ports[service_port["targetPort"]] == int(port) == service_port["port"]
    # every spot label is excluded in the one required term
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    excluded = {e["key"]: e["values"] for e in term["matchExpressions"] if e["operator"] == "NotIn"}
    for key, value in SPOT_LABELS.items():
        assert value in excluded.get(key, []), f"coordinator may land on spot nodes ({key})"
    assert not pod.get("tolerations")


def test_agents_join_the_coordinator_on_spot_with_a_drain() -> None:
    dep, pod = _workload("Deployment", "bamboo-agent")
    command = _container(pod)["command"]
    assert command[:3] == ["bamboo", "agent", "--join"]
    service = _one("Service", "bamboo-coordinator")
    host, port = _flag(command, "--join").rsplit(":", 1)
    assert host.split(".")[:2] == [service["metadata"]["name"], NAMESPACE]
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert _flag(command, "--token-file") == _token_path(pod)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    selected = {e["key"]: e["values"] for t in terms for e in t["matchExpressions"]
                if e["operator"] == "In"}
    assert all(value in selected[key] for key, value in SPOT_LABELS.items())
    tolerated = {t["key"] for t in pod["tolerations"]}
    assert {"cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority"} <= tolerated
    assert 30 <= pod["terminationGracePeriodSeconds"] <= 120
    hook = " ".join(_container(pod)["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in hook or "bamboo agent --drain" in hook, hook
    assert _container(pod)["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kustomization_lists_the_manifests_but_not_the_placeholder_secret() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == NAMESPACE
    listed = set(kustomization["resources"])
    assert all((KUBE / name).is_file() for name in listed)
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"secret.yaml"}


# -- systemd ----------------------------------------------------------------------------------


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((SYSTEMD / name).read_text())
    assert parser.sections() == ["Unit", "Service", "Install"]
    return parser


def _env() -> dict[str, str]:
    lines = (SYSTEMD / "bamboo.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


@pytest.mark.parametrize("name,args,timeout", [
    ("bamboo-coordinator.service", ["coordinator", "--bind", "${BAMBOO_BIND}"], 30),
    ("bamboo-agent.service", ["agent", "--join", "${BAMBOO_COORDINATOR}"], 110),
])
def test_systemd_unit(name: str, args: list[str], timeout: int) -> None:
    service = _unit(name)["Service"]
    command = service["ExecStart"].split()
    assert command[0].endswith("/bin/bamboo") and command[1:4] == args
    assert _flag(command, "--token-file") == "/etc/bamboo/token"
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) == timeout
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "/etc/bamboo/bamboo.env"
    used = set(re.findall(r"\$\{?(\w+)\}?", service["ExecStart"]))
    assert used <= set(_env()), f"{used - set(_env())} not defined in bamboo.env"
    assert _unit(name)["Install"]["WantedBy"] == "multi-user.target"


def test_env_file_addresses() -> None:
    env = _env()
    assert re.fullmatch(r"[\w.-]+:\d+", env["BAMBOO_BIND"])
    assert re.fullmatch(r"[\w.-]+:\d+", env["BAMBOO_COORDINATOR"])
    assert env["BAMBOO_BIND"].rsplit(":", 1)[1] == env["BAMBOO_COORDINATOR"].rsplit(":", 1)[1]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    bamboo = REPO / ".venv" / "bin" / "bamboo"
    executable = bamboo if bamboo.exists() else Path(shutil.which("true") or "/bin/true")
    units = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={executable}", unit.read_text(), flags=re.M)
        units.append(tmp_path / unit.name)
        units[-1].write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
