"""Deployment files: the Dockerfile, Kubernetes manifests against the API's own models,
systemd units, each checked against the `bamboo` command line they run.

Every manifest is walked strictly against the `kubernetes` client's models (each key
must be a field of that model, each value of the field's type) and then deserialized
into them, which also enforces required fields. Then the wiring: the containers' argv
(the image's ENTRYPOINT plus `args`) is parsed by `bamboo.cli.coordinator.coordinator_parser()` /
`agent_parser()` themselves, so an unknown or malformed flag fails here, and the ports of
the Service, the containers and the probes are the ones those flags give; agents join
the headless Service's DNS name that the coordinator advertises; the run directory lies
on the shared volume both mount; the Jobs' restart and completion semantics; spot and
on-demand placement; the drain hook. The systemd units' ExecStart lines are expanded with
bamboo.env and parsed the same way. The Dockerfile is parsed and linted structurally
(hadolint too, where it is installed).

Its tests that start processes: tests/integration/test_deploy_runs.py."""
from __future__ import annotations

import configparser
import fnmatch
import json
import re
import shlex
import tomllib
from argparse import ArgumentParser, Namespace
from pathlib import Path
from typing import Any

import pytest
import yaml

from bamboo.cli.agent import agent_parser
from bamboo.cli.coordinator import coordinator_parser
from bamboo.config import JOIN_PORT, JobConfig
from support.kube import check_model as _check
from support.procs import REPO

k8s = pytest.importorskip("kubernetes.client", reason="the `kubernetes` test dependency")

KUBE = REPO / "deploy" / "kubernetes"
SYSTEMD = REPO / "deploy" / "systemd"
DOCKERFILE = REPO / "Dockerfile"
DOCS_PAGE = REPO / "docs" / "deploy.md"
MODELS = {("v1", "Namespace"): "V1Namespace", ("v1", "Secret"): "V1Secret",
          ("v1", "Service"): "V1Service",
          ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
          ("batch/v1", "Job"): "V1Job",
          ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
          ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy"}
NAMESPACE = "bamboo"
CLUSTER_DOMAIN = "svc.cluster.local"
SPOT_LABELS = {"eks.amazonaws.com/capacityType": "SPOT", "cloud.google.com/gke-spot": "true",
               "cloud.google.com/gke-preemptible": "true",
               "kubernetes.azure.com/scalesetpriority": "spot",
               "karpenter.sh/capacity-type": "spot"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def _docs_page_manifests() -> list[tuple[str, dict]]:
    """The Kubernetes objects shown in docs/deploy.md's ```yaml blocks (checked like the files)."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOCS_PAGE.read_text(), flags=re.M | re.S)
    return [("docs/deploy.md", doc) for block in blocks for doc in yaml.safe_load_all(block)
            if isinstance(doc, dict) and "apiVersion" in doc]


DOCS = _documents()
CHECKED = DOCS + _docs_page_manifests()


def _by_kind(kind: str) -> list[dict]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _one(kind: str, name: str) -> dict:
    found = [d for d in _by_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# -- strict structural check against the client's models -----------------------------------


@pytest.mark.parametrize("index", range(len(CHECKED)),
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in CHECKED])
def test_manifest_matches_the_kubernetes_api(index: int) -> None:
    filename, doc = CHECKED[index]
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
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"parallelism": "4", "template": {"spec": {"containers": [
               {"name": "a", "comand": ["bamboo"]}]}}}}
    _check(bad, "V1Job", "j", errors)
    assert any("spec.parallelism: expected int" in e for e in errors), errors
    assert any("unknown field 'comand'" in e for e in errors), errors
    missing_name = {"apiVersion": "v1", "kind": "Service", "metadata": {},
                    "spec": {"ports": [{"name": "x"}]}}  # a ServicePort needs its port
    with pytest.raises(Exception, match="port"):
        k8s.ApiClient()._ApiClient__deserialize(missing_name, "V1Service")


# -- the Dockerfile -------------------------------------------------------------------------

_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                 "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                 "SHELL"}


def _dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comment lines dropped (also inside a continued
    instruction, as Docker does), backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            word, _, rest = whole.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    path = path.strip("/")
    hit = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            hit = not negate
    return hit


def _image() -> dict[str, Any]:
    """The Dockerfile's facts the manifests rely on: base, ENTRYPOINT, USER, ports, installs."""
    steps = _dockerfile(DOCKERFILE.read_text())
    unknown = [word for word, _ in steps if word not in _INSTRUCTIONS]
    assert not unknown, f"unknown Dockerfile instructions {unknown}"
    args: dict[str, str] = {}
    froms = []
    facts: dict[str, Any] = {"copied": [], "pip": [], "expose": set(), "user": None,
                             "entrypoint": None}
    for word, rest in steps:
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), rest.split()[0])
            froms.append(image)
        elif word in ("COPY", "ADD"):
            assert word == "COPY", "use COPY (ADD fetches URLs and unpacks archives)"
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            assert not any(p.startswith("--from") for p in shlex.split(rest))
            facts["copied"].extend(parts[:-1])
        elif word == "RUN" and "pip install" in rest:
            # resolve the build args the command uses, as the shell would with their defaults
            facts["pip"].extend(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), cmd)
                                for cmd in rest.split("&&") if "pip install" in cmd)
        elif word == "EXPOSE":
            facts["expose"] |= {int(p.split("/")[0]) for p in rest.split()}
        elif word == "USER":
            facts["user"] = rest
        elif word == "ENTRYPOINT":
            assert rest.startswith("["), "ENTRYPOINT must be the exec form (bamboo is PID 1)"
            facts["entrypoint"] = json.loads(rest)
    assert len(froms) == 1, f"one stage expected, found FROM {froms}"
    facts["base"] = froms[0]
    return facts


def test_dockerfile_builds_the_package_as_a_non_root_bamboo_entrypoint() -> None:
    image = _image()
    assert image["base"] == "python:3.11-slim", image["base"]
    # installs: every pip install is held to constraints.txt, and the package is installed
    # non-editable, without a cache, with torch's CPU index by default
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert "torch==2.13.0" in pins
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    assert image["pip"], "no pip install in the Dockerfile"
    for cmd in image["pip"]:
        words = shlex.split(cmd)
        assert "--no-cache-dir" in words, cmd
        assert words[words.index("-c") + 1] == "constraints.txt", cmd
        assert words[words.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
        assert "-e" not in words and "--editable" not in words, cmd
    assert any(shlex.split(cmd)[-1] == "." for cmd in image["pip"]), "the package is not installed"
    # COPY sources exist and are not excluded from the context; what pip builds is there
    ignore = _dockerignore()
    for source in image["copied"]:
        assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
        assert not _ignored(source, ignore), f"COPY {source}: excluded by .dockerignore"
    needed = {"constraints.txt", "pyproject.toml", project["readme"], "src"}
    assert needed <= set(image["copied"])
    for heavy in (".venv", "runs", ".git", "__pycache__/x.pyc", ".pytest_cache"):
        assert _ignored(heavy, ignore), f"{heavy} would be sent to the docker build"
    # runs as a non-root user, the pods' runAsUser; `bamboo` is the ENTRYPOINT
    user, _, group = image["user"].partition(":")
    assert user.isdigit() and int(user) != 0 and group != "0", f"USER {image['user']}"
    for pod in (_coordinator()[1], _agents()[1]):
        assert pod["securityContext"]["runAsUser"] == int(user)
    assert image["entrypoint"] == ["bamboo"]
    assert project["scripts"]["bamboo"] == "bamboo.cli:main"
    assert image["expose"] == {JOIN_PORT, JOIN_PORT + 1, JOIN_PORT + 2}
    # the GPU variant is documented and selectable by build args
    text = DOCKERFILE.read_text()
    assert "ARG BASE=python:3.11-slim" in text and "ARG TORCH_INDEX=" in text
    assert "nvidia/cuda:" in text and "download.pytorch.org/whl/cu" in text


def test_the_dockerfile_lint_catches_mistakes() -> None:
    steps = _dockerfile("# c\nFROM x\nRUN a \\\n  # inner comment\n  b\nuser 0\n")
    assert [(word, rest.split()) for word, rest in steps] == [
        ("FROM", ["x"]), ("RUN", ["a", "b"]), ("USER", ["0"])]
    assert _ignored(".venv", [".venv"]) and _ignored("a/__pycache__", ["**/__pycache__"])
    assert not _ignored("bamboo", [".venv", "!bamboo"])


# -- wiring ---------------------------------------------------------------------------------


def _parse(parser: ArgumentParser, argv: list[str]) -> Namespace:
    """`parser`'s reading of `argv`, or the test fails: an unknown flag, a bad value, and
    also an abbreviation (which argparse would accept: `--worker` for `--workers`)."""
    exact = {name for action in parser._actions for name in action.option_strings}
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in exact:
            pytest.fail(f"`{parser.prog}` rejects {argv}: {flag} is not one of its flags")
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # a usage error: argparse already said which flag on stderr
        pytest.fail(f"`{parser.prog}` rejects {argv} (exit {e.code})")


def _argv(container: dict) -> list[str]:
    """What the container runs: its command, else the image's ENTRYPOINT, then its args."""
    command = container.get("command") or _image()["entrypoint"]
    argv = [*command, *container.get("args", [])]
    assert Path(argv[0]).name == "bamboo", argv
    return argv


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    assert host and port.isdigit(), f"{value!r} is not HOST:PORT"
    return host, int(port)


def _job(name: str) -> tuple[dict, dict]:
    job = _one("Job", name)
    pod = job["spec"]["template"]
    assert "selector" not in job["spec"], "let the Job controller generate its selector"
    return job, pod


def _container(pod: dict) -> dict:
    assert len(pod["spec"]["containers"]) == 1
    return pod["spec"]["containers"][0]


def _coordinator() -> tuple[dict, dict]:
    job, pod = _job("bamboo-coordinator")
    return job, pod["spec"]


def _agents() -> tuple[dict, dict]:
    job, pod = _job("bamboo-agent")
    return job, pod["spec"]


def _coordinator_args() -> Namespace:
    argv = _argv(_container(_coordinator()[0]["spec"]["template"]))
    assert argv[1] == "coordinator"
    return _parse(coordinator_parser(), argv[2:])


def _agent_args() -> Namespace:
    argv = _argv(_container(_agents()[0]["spec"]["template"]))
    assert argv[1] == "agent"
    return _parse(agent_parser(), argv[2:])


def _job_config(args: Namespace) -> JobConfig:
    """The job the coordinator's flags describe, validated as `bamboo coordinator` does."""
    from bamboo.cli.train import job_config
    return job_config(args, [], coordinator_parser(given_only=True))


def _token_path(spec: dict) -> str:
    secret = _one("Secret", "bamboo-join-token")
    assert "token" in secret["stringData"]
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount.get("readOnly") is True
    item = next(i for i in volume["secret"]["items"] if i["key"] == "token")
    return f"{mount['mountPath']}/{item['path']}"


def _runs_mount(spec: dict) -> str:
    """Where the pod mounts the run directory's ReadWriteMany claim."""
    claim = _one("PersistentVolumeClaim", "bamboo-runs")
    (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert not mount.get("readOnly") and "subPath" not in mount
    return mount["mountPath"]


def _named_ports(container: dict) -> dict[str, int]:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert len(ports) == len(container["ports"]) and all(len(n) <= 15 for n in ports)
    return ports


def _probe_port(probe: dict, container: dict) -> int:
    assert set(probe) & {"httpGet", "tcpSocket", "exec", "grpc"} == {"httpGet"}, probe
    assert probe["httpGet"]["path"] == "/healthz"
    port = probe["httpGet"]["port"]
    return _named_ports(container)[port] if isinstance(port, str) else port


def _check_probes(container: dict, http_port: int) -> None:
    assert {"readinessProbe", "livenessProbe"} <= set(container)
    for name in PROBES:
        if name in container:
            assert _probe_port(container[name], container) == http_port, name
    # a liveness probe that gives up in less than a minute would kill slow-but-alive pods
    live = container["livenessProbe"]
    assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) >= 60


def _spot_terms(spec: dict) -> list[list[dict]]:
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    return [t["matchExpressions"] for t in terms]


def _advertised_name(spec: dict) -> str:
    return f"{spec['hostname']}.{spec['subdomain']}.{NAMESPACE}.{CLUSTER_DOMAIN}"


def test_coordinator_flags_ports_and_service_agree() -> None:
    job, spec = _coordinator()
    container = spec["containers"][0]
    args = _coordinator_args()
    bind_host, join = _hostport(args.bind)
    store = args.store_port if args.store_port is not None else join + 1
    http_host, http = _hostport(args.http)
    assert bind_host == "0.0.0.0" and http_host == "0.0.0.0", "a pod must listen on all addresses"
    assert (join, store, http) == (JOIN_PORT, JOIN_PORT + 1, JOIN_PORT + 2)
    assert _named_ports(container) == {"join": join, "store": store, "http": http}
    # the headless Service: the pod's stable name, every port the job uses
    service = _one("Service", spec["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"].get("publishNotReadyAddresses") is True
    ports = _named_ports(container)
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        assert (ports[target] if isinstance(target, str) else target) == port["port"], port
    assert {p["port"] for p in service["spec"]["ports"]} == {join, store, http}
    assert args.advertise == _advertised_name(spec)
    _check_probes(container, http)
    annotations = job["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port") == str(http)
    assert args.token_file == _token_path(spec)


def test_coordinator_job_resumes_on_failure_and_ends_with_the_run() -> None:
    job, spec = _coordinator()
    args = _coordinator_args()
    assert job["spec"].get("completions", 1) == 1 and job["spec"].get("parallelism", 1) == 1
    assert job["spec"].get("completionMode", "NonIndexed") == "NonIndexed"
    assert spec["restartPolicy"] == "OnFailure"
    assert job["spec"]["backoffLimit"] >= 5
    # one command line for the first start and every restart: it continues its own run
    assert args.resume == "auto" and args.out
    mount = _runs_mount(spec)
    assert Path(args.out).is_relative_to(mount) and Path(args.out) != Path(mount)
    cfg = _job_config(args)
    assert cfg.checkpoints.every != 0, "a resumed coordinator needs checkpoints to resume from"
    assert cfg.checkpoints.keep >= 2
    assert args.join_timeout_s >= 600
    # memory sized for a process that holds no tensors (docs: ~550 MiB measured)
    parse_quantity = pytest.importorskip("kubernetes.utils").parse_quantity
    resources = spec["containers"][0]["resources"]
    request, limit = (parse_quantity(resources[k]["memory"]) for k in ("requests", "limits"))
    assert 512 * 2**20 <= request <= limit <= 8 * 2**30
    assert "nvidia.com/gpu" not in resources.get("limits", {})


def test_coordinator_runs_on_demand_and_is_not_evicted() -> None:
    job, spec = _coordinator()
    (term,) = _spot_terms(spec)  # one term: every exclusion must hold at once
    excluded = {e["key"]: e["values"] for e in term if e["operator"] == "NotIn"}
    for key, value in SPOT_LABELS.items():
        assert value in excluded.get(key, []), f"coordinator may land on spot nodes ({key})"
    assert not spec.get("tolerations")
    (pdb,) = _by_kind("PodDisruptionBudget")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # a Job's pods admit only an integer minAvailable (maxUnavailable needs a scalable owner)
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]


def test_agents_join_the_advertised_coordinator() -> None:
    job, spec = _agents()
    container = spec["containers"][0]
    args, coordinator = _agent_args(), _coordinator_args()
    host, port = _hostport(args.join)
    _, coordinator_spec = _coordinator()
    # the headless Service's DNS name of the coordinator's pod, and its join port
    assert host == coordinator.advertise == _advertised_name(coordinator_spec)
    service = _one("Service", host.split(".")[1])
    assert host.split(".")[2] == NAMESPACE
    assert port == _hostport(coordinator.bind)[1]
    assert next(p for p in service["spec"]["ports"] if p["name"] == "join")["port"] == port
    assert args.token_file == _token_path(spec)
    assert args.token is None
    # one worker per GPU; the job's nodes are every agent's workers
    workers = args.workers
    assert str(workers) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert _job_config(coordinator).layout.nodes == job["spec"]["parallelism"] * workers
    assert args.rejoin_s >= 300, "rejoin for longer than the kubelet's longest back-off (5 min)"
    assert set(args.notices.split(",")) <= {"aws", "gcp", "azure"}
    http_host, http = _hostport(args.http)
    assert http_host == "0.0.0.0"
    assert _named_ports(container) == {"http": http}
    _check_probes(container, http)
    # the same run directory at the same path as the coordinator's
    assert _runs_mount(spec) == _runs_mount(coordinator_spec)
    assert Path(coordinator.out).is_relative_to(_runs_mount(spec))


def test_agents_job_replaces_preempted_pods_and_ends_with_the_run() -> None:
    job, spec = _agents()
    js = job["spec"]
    assert js["completionMode"] == "Indexed"
    assert js["completions"] == js["parallelism"] >= 1
    assert spec["restartPolicy"] == "Never"
    # preemptions (DisruptionTarget) never count against backoffLimit
    (rule,) = [r for r in js["podFailurePolicy"]["rules"]
               if any(c["type"] == "DisruptionTarget" for c in r.get("onPodConditions", []))]
    assert rule["action"] == "Ignore"
    assert js.get("podReplacementPolicy", "Failed") == "Failed"  # the only value allowed then
    assert js["backoffLimit"] >= js["parallelism"]


def test_agents_run_on_spot_with_a_drain() -> None:
    _, spec = _agents()
    container = spec["containers"][0]
    selected = {e["key"]: e["values"] for t in _spot_terms(spec) for e in t
                if e["operator"] == "In"}
    assert all(value in selected.get(key, []) for key, value in SPOT_LABELS.items())
    assert all(len(t) == 1 for t in _spot_terms(spec)), "one label per term: terms are ORed"
    tolerated = {t["key"] for t in spec["tolerations"]}
    assert {"cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority",
            "nvidia.com/gpu"} <= tolerated
    assert spec["terminationGracePeriodSeconds"] == 110
    hook = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in hook or "bamboo agent --drain" in hook, hook
    (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["name"] == "shm" and m["mountPath"] == "/dev/shm"
               for m in container["volumeMounts"])


def test_the_flag_check_catches_mistakes() -> None:
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _parse(agent_parser(), ["--join", "x:29400", "--worker", "8"])
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _parse(agent_parser(), ["--join", "x:29400", "--rejoin", "600"])
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _parse(coordinator_parser(), ["--store-port", "twenty"])
    assert _hostport("a.b.svc.cluster.local:29400") == ("a.b.svc.cluster.local", 29400)


def test_run_directory_claim_is_shared() -> None:
    claim = _one("PersistentVolumeClaim", "bamboo-runs")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"]


def test_kustomization_lists_the_manifests_but_not_the_placeholder_secret() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == NAMESPACE
    listed = set(kustomization["resources"])
    assert all((KUBE / name).is_file() for name in listed)
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"secret.yaml"}


def test_docs_list_every_port() -> None:
    text = DOCS_PAGE.read_text()
    args = _coordinator_args()
    join = _hostport(args.bind)[1]
    for port in (join, args.store_port or join + 1, _hostport(args.http)[1]):
        assert f"{port}" in text
    for words in ("ephemeral", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                  "not yet run on a real cluster"):
        assert words in text, words


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


def _exec_start(name: str) -> list[str]:
    """ExecStart as systemd runs it with bamboo.env: `${X}` is one word, `$X` is split."""
    env = _env()
    argv: list[str] = []
    for word in _unit(name)["Service"]["ExecStart"].split():
        if re.fullmatch(r"\$\w+", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], word))
    return argv


@pytest.mark.parametrize("name,args,timeout", [
    ("bamboo-coordinator.service", ["coordinator", "--bind", "${BAMBOO_BIND}"], 30),
    ("bamboo-agent.service", ["agent", "--join", "${BAMBOO_COORDINATOR}"], 110),
])
def test_systemd_unit(name: str, args: list[str], timeout: int) -> None:
    service = _unit(name)["Service"]
    command = service["ExecStart"].split()
    assert command[0].endswith("/bin/bamboo") and command[1:4] == args
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) == timeout
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "/etc/bamboo/bamboo.env"
    used = set(re.findall(r"\$\{?(\w+)\}?", service["ExecStart"]))
    assert used <= set(_env()), f"{used - set(_env())} not defined in bamboo.env"
    assert _unit(name)["Install"]["WantedBy"] == "multi-user.target"
    # the shared run directory is mounted before either starts
    assert Path(_env()["BAMBOO_OUT"]).is_relative_to(_unit(name)["Unit"]["RequiresMountsFor"])


def test_systemd_command_lines_parse_and_agree() -> None:
    env = _env()
    coordinator = _parse(coordinator_parser(), _exec_start("bamboo-coordinator.service")[2:])
    agent = _parse(agent_parser(), _exec_start("bamboo-agent.service")[2:])
    assert coordinator.token_file == agent.token_file == "/etc/bamboo/token"
    # restarts continue the run in the shared directory
    assert coordinator.resume == "auto" and coordinator.out == env["BAMBOO_OUT"]
    assert _job_config(coordinator).checkpoints.every > 0
    # agents join the advertised name on the join port; the store is the next port
    join_host, join_port = _hostport(agent.join)
    assert join_host == coordinator.advertise
    assert join_port == _hostport(coordinator.bind)[1] == JOIN_PORT
    assert (coordinator.store_port or join_port + 1) == join_port + 1
    assert _hostport(coordinator.http)[1] == _hostport(agent.http)[1] == JOIN_PORT + 2
    assert agent.workers >= 1 and agent.rejoin_s > 0
    assert set(agent.notices.split(",")) <= {"aws", "gcp", "azure"}
