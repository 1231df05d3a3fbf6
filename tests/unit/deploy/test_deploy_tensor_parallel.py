"""deploy/'s tensor-parallel overlays (issue 29), rendered as kustomize would
(test_deploy_manifests' loader): gpu-tensor-parallel (one executor group over the GPUs of
one pod) and gpu-multinode (one group over several pods, a LeaderWorkerSet). Every object
is valid offline: Kubernetes' kinds against kubernetes-validate's schemas, the
LeaderWorkerSet against its CRD's schema stored in deploy/schemas/ (its pod templates as
Kubernetes PodTemplates); the containers pass flags pagedserve accepts; the group's ranks,
as LWS's environment places them, cover every rank once, one per GPU claimed."""
from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.tp_group import layout_of
from tests.unit.deploy.test_deploy_manifests import (DEPLOY, K8S_VERSIONS, KUBE, ROOT, UID, help_text,
                                                     kustomize, parse_container, workload)
from pagedserve.wire.settings import from_args

OVERLAYS = ["gpu-tensor-parallel", "gpu-multinode"]
LWS_SCHEMA = DEPLOY / "schemas" / "leaderworkerset.x-k8s.io_v1.json"
SOURCES = "\n".join(p.read_text() for d in ("pagedserve", "pagedserve/gateway", "pagedserve/memsvc", "pagedserve/executor")
                    for p in (ROOT / d).rglob("*.py"))


def render(overlay: str) -> list[dict]:
    return kustomize(KUBE / "overlays" / overlay)


def pod_templates(objects) -> list[tuple[str, dict]]:
    """(name, pod template) of every workload: StatefulSets and Deployments, and both
    templates of a LeaderWorkerSet."""
    out = []
    for o in objects:
        spec = o.get("spec", {})
        if "template" in spec:
            out.append((o["metadata"]["name"], spec["template"]))
        if o["kind"] == "LeaderWorkerSet":
            t = spec["leaderWorkerTemplate"]
            out += [(o["metadata"]["name"] + "/leader", t["leaderTemplate"]),
                    (o["metadata"]["name"] + "/worker", t["workerTemplate"])]
    return out


def executor_config(container: dict) -> ExecutorConfig:
    return from_args(ExecutorConfig, parse_container(container))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(overlay, version):
    stored = json.loads(LWS_SCHEMA.read_text())
    errors = []
    for o in render(overlay):
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "LeaderWorkerSet":
            assert o["apiVersion"] == f"{stored['group']}/{stored['version']}"
            for e in jsonschema.Draft7Validator(stored["schema"]).iter_errors(o):
                errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")
            for part, template in pod_templates([o]):
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": part.replace("/", "-")}, "template": template}
                try:
                    kubernetes_validate.validate(wrapped, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    errors.append(f"{part}: {'.'.join(map(str, e.path))}: {e.message}")
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)


def test_the_stored_schema_rejects_what_lws_rejects():
    validator = jsonschema.Draft7Validator(json.loads(LWS_SCHEMA.read_text())["schema"])
    [lws] = [o for o in render("gpu-multinode") if o["kind"] == "LeaderWorkerSet"]
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    messages = [e.message for e in validator.iter_errors(bad)]
    assert any("Always" in m for m in messages) and any("workerTemplate" in m for m in messages)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_hold_the_deployments_rules(overlay):
    for name, template in pod_templates(render(overlay)):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == UID
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), (name, c["name"])
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, (name, c["name"])
            if c.get("command") == ["pagedserve"]:
                executor_or_other = parse_container(c)
                assert executor_or_other.command == c["name"], (name, c["name"])
                for env in c.get("env", []):
                    if env["name"].startswith("PAGEDSERVE_"):
                        assert env["name"] in help_text(c["name"]) or f'"{env["name"]}"' in SOURCES, \
                            f"{name} {c['name']}: {env['name']} is read by nothing"


def test_one_pod_group_has_a_rank_per_gpu():
    objects = render("gpu-tensor-parallel")
    pod = workload(objects, "StatefulSet", "pagedserve-executor")["spec"]["template"]["spec"]
    [c] = [c for c in pod["containers"] if c["name"] == "executor"]
    config = executor_config(c)
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert config.tensor_parallel_size == gpus > 1 and config.device == "cuda:0"
    layout = layout_of(config.tensor_parallel_size, config.tensor_parallel_group, env={})
    assert list(layout.local_ranks) == list(range(gpus)) and layout.host == "127.0.0.1"


def test_multinode_group_covers_every_rank_once_from_lws_env():
    objects = render("gpu-multinode")
    assert not [o for o in objects if o["kind"] == "StatefulSet"], "the LWS replaces the StatefulSet"
    lws = workload(objects, "LeaderWorkerSet", "pagedserve-tp")
    t = lws["spec"]["leaderWorkerTemplate"]
    size = t["size"]
    assert t["restartPolicy"] == "RecreateGroupOnPodRestart" and size > 1
    leader, worker = t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]
    assert {c["name"] for c in leader["containers"]} == {"memsvc", "executor"}
    assert [c["name"] for c in worker["containers"]] == ["executor"]
    env = {"LWS_LEADER_ADDRESS": "pagedserve-tp-0.pagedserve-tp.default", "LWS_GROUP_SIZE": str(size)}
    ranks, world = [], None
    for index in range(size):
        pod = leader if index == 0 else worker
        [c] = [c for c in pod["containers"] if c["name"] == "executor"]
        config = executor_config(c)
        layout = layout_of(config.tensor_parallel_size, config.tensor_parallel_group,
                           env=dict(env, LWS_WORKER_INDEX=str(index)))
        assert layout.host == env["LWS_LEADER_ADDRESS"] and layout.nodes == size
        assert len(layout.local_ranks) == c["resources"]["limits"]["nvidia.com/gpu"]
        world = world or config.tensor_parallel_size
        assert config.tensor_parallel_size == world
        ranks += list(layout.local_ranks)
        if index == 0:  # rank 0 listens for the group where it said
            assert layout.port in {p["containerPort"] for p in c["ports"]}
            assert config.memsvc == "127.0.0.1:50052"
    assert sorted(ranks) == list(range(world))


def test_multinode_routing_reaches_leaders_only():
    objects = render("gpu-multinode")
    lws = workload(objects, "LeaderWorkerSet", "pagedserve-tp")
    t = lws["spec"]["leaderWorkerTemplate"]
    labels = lambda key: t[key]["metadata"]["labels"]  # noqa: E731
    service = workload(objects, "Service", "pagedserve-executor")
    selector = service["spec"]["selector"].items()
    assert selector <= labels("leaderTemplate").items() and not selector <= labels("workerTemplate").items()
    hpa = workload(objects, "HorizontalPodAutoscaler", "pagedserve-executor")["spec"]["scaleTargetRef"]
    assert (hpa["apiVersion"], hpa["kind"], hpa["name"]) == (lws["apiVersion"], "LeaderWorkerSet", "pagedserve-tp")
    group = workload(objects, "NetworkPolicy", "pagedserve-executor-group")["spec"]
    assert group["podSelector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/name"] == "pagedserve-tp"
    gateway = workload(objects, "Deployment", "pagedserve-gateway")
    [c] = [c for c in gateway["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    assert parse_container(c).discover == "pagedserve-executor"
