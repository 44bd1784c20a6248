"""KubeRay's manifests (deploy/kuberay): a RayCluster with its head on on-demand capacity and a
spot worker group, and a RayJob running `bamboo train --ray auto` on it.

KubeRay's own types are not in the `kubernetes` client, so their fields are checked here by
name (apiVersion, kind, the fields KubeRay requires), and every pod template inside them
strictly against the client's `V1PodTemplateSpec`. The RayJob's entrypoint is parsed by
`bamboo train`'s own parser and checked as a job."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from bamboo.cli.train import job_config, train_parser
from support.kube import check_model, k8s
from support.procs import REPO

KUBERAY = REPO / "deploy" / "kuberay"
SPOT_KEYS = {"eks.amazonaws.com/capacityType": "SPOT", "karpenter.sh/capacity-type": "spot",
             "cloud.google.com/gke-spot": "true"}


def _doc(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]
    assert len(docs) == 1, f"{name}: one object per file"
    return docs[0]


CLUSTER, JOB = _doc("raycluster.yaml"), _doc("rayjob.yaml")


def _pod_template(template: dict, where: str) -> None:
    errors: list[str] = []
    check_model(template, "V1PodTemplateSpec", where, errors)
    assert not errors, "\n".join(errors)
    k8s.ApiClient()._ApiClient__deserialize(template, "V1PodTemplateSpec")  # required fields
    assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bamboo"


def _match(affinity: dict) -> list[dict]:
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]


def test_the_files_are_kuberay_objects_in_the_bamboo_namespace() -> None:
    assert sorted(p.name for p in KUBERAY.glob("*.yaml")) == ["raycluster.yaml", "rayjob.yaml"]
    for doc, kind in ((CLUSTER, "RayCluster"), (JOB, "RayJob")):
        assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", kind)
        assert doc["metadata"]["namespace"] == "bamboo" and doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bamboo"


def test_the_cluster_has_an_on_demand_head_and_an_autoscaled_spot_worker_group() -> None:
    spec = CLUSTER["spec"]
    pins = (REPO / "constraints.txt").read_text().split()
    assert f"ray=={spec['rayVersion']}" in pins, "rayVersion is the ray extra's pin"
    head = spec["headGroupSpec"]
    _pod_template(head["template"], "headGroupSpec.template")
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head["rayStartParams"]["num-cpus"] == "0", "no Bamboo node on the head"
    head_terms = _match(head["template"]["spec"]["affinity"])
    assert not any(e.get("operator") == "In" and SPOT_KEYS.get(e["key"]) in e["values"]
                   for e in head_terms), "the head (the driver) must not land on spot"
    assert spec["enableInTreeAutoscaling"] is True
    [group] = spec["workerGroupSpecs"]
    assert group["groupName"] and isinstance(group["rayStartParams"], dict)
    assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    _pod_template(group["template"], "workerGroupSpecs[0].template")
    pod = group["template"]["spec"]
    spot = {(e["key"], v) for e in _match(pod["affinity"]) for v in e["values"]}
    assert spot == set(SPOT_KEYS.items())
    assert {t["key"] for t in pod["tolerations"]} >= {"cloud.google.com/gke-spot",
                                                       "kubernetes.azure.com/scalesetpriority"}
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one Bamboo node a pod


def test_every_pod_mounts_the_shared_run_directory() -> None:
    pvc = yaml.safe_load((REPO / "deploy" / "kubernetes" / "pvc.yaml").read_text())
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    for template in (CLUSTER["spec"]["headGroupSpec"]["template"],
                     CLUSTER["spec"]["workerGroupSpecs"][0]["template"]):
        pod = template["spec"]
        [volume] = pod["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": volume["name"], "mountPath": "/data"} in mounts


def test_the_job_runs_bamboo_train_on_ray_from_the_shared_directory() -> None:
    spec = JOB["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": CLUSTER["metadata"]["name"]}
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode")
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["bamboo", "train"]
    args = train_parser().parse_args(argv[2:])
    cfg = job_config(args, argv[2:], train_parser(given_only=True)).validate()
    assert cfg.ray.address == "auto" and cfg.checkpoints.resume == "auto"
    assert Path(cfg.logging.out or "").is_relative_to("/data"), "the run on the shared volume"
    assert cfg.node_cap >= cfg.layout.nodes


@pytest.mark.parametrize("where", ["docs/deploy.md", "README.md"])
def test_the_pages_point_at_the_kuberay_manifests(where: str) -> None:
    assert "deploy/kuberay" in (REPO / where).read_text()
