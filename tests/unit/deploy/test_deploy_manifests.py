"""deploy/: the Kubernetes manifests, rendered as kustomize would, are valid against the
Kubernetes API schemas (offline, kubernetes-validate's bundled schemas, no cluster), pass
pagedserve only flags and ports it accepts, and hold together (names, ports, volumes).

The overlays are rendered by a small loader below that does what kustomize does for the
features they use (resources, strategic-merge patches by file, images); where `kubectl` is
installed its kustomize checks the loader (tests/system/test_deploy_kustomize.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagedserve.cli import build_parser
from tests.support import REPO as ROOT

DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
OVERLAYS = ["cpu", "gpu"]
# Oldest version with every feature used (native gRPC probes are GA in 1.27), and the newest
# whose schemas the validator bundles.
K8S_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]
UID = 10001
# Strategic-merge keys of the pod lists that patches merge into; other lists are replaced
# whole (kubectl's kustomize, where present, checks that the patches need no more).
MERGE_KEYS = {"containers": "name", "volumes": "name", "env": "name", "volumeMounts": "mountPath"}


# ---------------------------------------------------------------- rendering (kustomize)

def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(base, patch, key: str | None = None):
    """Strategic merge: maps merge by key (null deletes), keyed lists merge by their key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif isinstance(v, dict):
                out[k] = merge(out.get(k, {}), v, k)
            else:
                out[k] = merge(out.get(k), v, k)
        return out
    merge_key = MERGE_KEYS.get(key)
    if isinstance(base, list) and isinstance(patch, list) and merge_key:
        out = list(base)
        for item in patch:
            at = [i for i, b in enumerate(out) if b.get(merge_key) == item[merge_key]]
            if at:
                out[at[0]] = merge(out[at[0]], item)
            else:
                out.append(merge({}, item))
        return out
    return patch


def same_object(a: dict, b: dict) -> bool:
    return (a["kind"], a["metadata"]["name"]) == (b["kind"], b["metadata"]["name"])


def kustomize(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unknown, f"{directory}: the test's loader does not apply {sorted(unknown)}"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        objects += kustomize(path) if path.is_dir() else load_docs(path)
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only strategic-merge patches by path"
        for patch in load_docs(directory / entry["path"]):
            at = [i for i, o in enumerate(objects) if same_object(o, patch)]
            assert len(at) == 1, f"{entry['path']}: patches nothing"
            if patch.get("$patch") == "delete":
                del objects[at[0]]
            else:
                objects[at[0]] = merge(objects[at[0]], patch)
    for image in k.get("images", []):
        for c in containers(objects):
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = image.get("newName", name) + (
                    "@" + image["digest"] if "digest" in image else ":" + image.get("newTag", tag))
    return objects


def containers(objects: list[dict]) -> list[dict]:
    return [c for o in objects if "template" in o.get("spec", {})
            for c in o["spec"]["template"]["spec"]["containers"]]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(KUBE / "overlays" / request.param)


def canonical(value):
    """Order-free form for comparing renders (kustomize moves patched list items first)."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    return value


# ---------------------------------------------------------------- schemas

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    sets = {"base": kustomize(KUBE / "base")}
    sets.update({o: kustomize(KUBE / "overlays" / o) for o in OVERLAYS})
    errors = []
    for name, objects in sets.items():
        for o in objects:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                errors.append(f"{name} {o['kind']}/{o['metadata']['name']}: {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{name}: {e.message}")
    assert not errors, "\n".join(errors)


def test_every_yaml_file_is_part_of_a_kustomization():
    used = set()
    for k in KUBE.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        used.add(k.resolve())
        used.update((k.parent / e).resolve() for e in spec.get("resources", []))
        used.update((k.parent / p["path"]).resolve() for p in spec.get("patches", []))
    stray = [p for p in KUBE.rglob("*.y*ml") if p.resolve() not in used]
    assert not stray, f"not in any kustomization (so never validated): {stray}"


# ---------------------------------------------------------------- pagedserve flags and ports

def parse(args: list[str]):
    """`pagedserve <args>` through the real parser; a failure shows argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"pagedserve {' '.join(args)}: {err.getvalue().strip()}")


def parse_container(c: dict):
    """A container's command line through the real parser, with its PAGEDSERVE_* variables
    set (flags fall back to them) and no others from this process."""
    env = {e["name"]: e["value"] for e in c.get("env", [])
           if "value" in e and e["name"].startswith("PAGEDSERVE_")}
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)
        return parse(c["args"])


def help_text(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return re.sub(r"\s+", " ", out.getvalue())


def pagedserve_containers(objects):
    found = [c for c in containers(objects) if c.get("command") == ["pagedserve"]]
    assert {c["name"] for c in found} == {"gateway", "memsvc", "executor"}
    return found


def workload(objects, kind, name):
    [o] = [o for o in objects if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return o


def test_containers_pass_flags_and_ports_that_pagedserve_accepts(rendered):
    _, objects = rendered
    sources = "\n".join(p.read_text() for d in ("pagedserve", "pagedserve/gateway", "pagedserve/memsvc", "pagedserve/executor")
                        for p in (ROOT / d).rglob("*.py"))
    for c in pagedserve_containers(objects):
        args = parse_container(c)
        assert args.command == c["name"]
        assert args.host == "0.0.0.0", f"{c['name']}: probes and peers reach the pod's address"
        ports = {p["containerPort"] for p in c["ports"]}
        assert args.port in ports, f"{c['name']} listens on {args.port}, declares {ports}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                action = c[probe].get("grpc") or c[probe].get("tcpSocket") or c[probe].get("httpGet")
                assert action["port"] in ports, f"{c['name']} {probe} port"
        # Readiness is the service's health: gRPC health on the plaintext health port (the
        # main port wants mutual TLS, which kubelet's probes cannot do), or the gateway's
        # HTTP /health.
        ready = c["readinessProbe"]
        if c["name"] == "gateway":
            assert ready["httpGet"] == {"path": "/health", "port": args.http_port}
            assert args.http_host == "0.0.0.0"
        else:
            assert ready["grpc"]["port"] == args.health_port != args.port
        for env in c.get("env", []):
            name = env["name"]
            if name.startswith("PAGEDSERVE_"):
                assert name in help_text(c["name"]) or f'"{name}"' in sources, \
                    f"{c['name']}: {name} is read by nothing"


def test_every_gateway_discovers_every_executor_through_the_headless_service(rendered):
    _, objects = rendered
    by_name = {c["name"]: c for c in pagedserve_containers(objects)}
    gateway = parse_container(by_name["gateway"])
    sts = workload(objects, "StatefulSet", "pagedserve-executor")
    service = workload(objects, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses"), "a draining pod must leave DNS"
    # Every address of the headless Service (every ready executor pod) is a replica; no
    # replica is named on its own (pagedserve-executor-0 would be the only one driven).
    assert gateway.discover == service["metadata"]["name"]
    assert gateway.replica in ([], None)
    assert "pagedserve-executor-" not in " ".join(by_name["gateway"]["args"])
    from pagedserve.gateway.discovery import parse_ports

    memsvc, executor = parse_container(by_name["memsvc"]), parse_container(by_name["executor"])
    assert parse_ports(gateway.discover_ports) == (memsvc.port, executor.port)
    assert {memsvc.port, executor.port} <= {p["port"] for p in service["spec"]["ports"]}
    assert executor.memsvc == f"127.0.0.1:{memsvc.port}"


def test_executor_pod_shares_what_the_pool_needs(rendered):
    overlay, objects = rendered
    pod = workload(objects, "StatefulSet", "pagedserve-executor")["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsUser"] == UID and pod["securityContext"]["runAsNonRoot"]
    [dshm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    by_name = {c["name"]: c for c in pod["containers"]}
    for name in ("memsvc", "executor"):
        assert {"name": "dshm", "mountPath": "/dev/shm"} in by_name[name]["volumeMounts"]
        assert "runAsUser" not in by_name[name].get("securityContext", {}), "one user for both"
    executor = parse_container(by_name["executor"])
    mounts = {m["mountPath"]: m["name"] for m in by_name["executor"]["volumeMounts"]}
    assert executor.model.startswith("/models/") and mounts["/models"] == "models"
    gpus = {n: c["resources"].get("limits", {}).get("nvidia.com/gpu") for n, c in by_name.items()}
    if overlay == "gpu":
        assert gpus == {"memsvc": None, "executor": 1} and executor.device == "cuda:0"
    else:
        assert gpus == {"memsvc": None, "executor": None} and executor.device == "cpu"


def test_objects_refer_to_each_other(rendered):
    _, objects = rendered
    pods = [o for o in objects if "template" in o.get("spec", {})]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}

    def selected(selector):
        return [p for p in pods if selector.items() <= p["spec"]["template"]["metadata"]["labels"].items()]

    for o in objects:
        spec = o.get("spec", {})
        if o["kind"] == "Service":
            [pod] = selected(spec["selector"])
            declared = {p["name"] for c in pod["spec"]["template"]["spec"]["containers"]
                        for p in c.get("ports", [])}
            assert {p["targetPort"] for p in spec["ports"]} <= declared, o["metadata"]["name"]
        if o["kind"] in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            assert selected(spec["selector"]["matchLabels"]), o["metadata"]["name"]
        if o["kind"] == "HorizontalPodAutoscaler":
            assert (spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"]) in names
            target = spec["scaleTargetRef"]
            assert "replicas" not in workload(objects, target["kind"], target["name"])["spec"]
    for p in pods:
        pod = p["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert set(c["resources"]) == {"requests", "limits"}, c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts {m['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names
            if "secret" in v:  # made by you or by deploy/cert-manager (test_deploy_security)
                assert v["secret"]["secretName"].startswith("pagedserve-tls-")


def test_pods_send_telemetry_to_the_collector(rendered):
    _, objects = rendered
    collector = workload(objects, "Service", "pagedserve-otel-collector")
    grpc_port = next(p["port"] for p in collector["spec"]["ports"] if p["name"] == "otlp-grpc")
    config = yaml.safe_load(workload(objects, "ConfigMap", "pagedserve-otel-collector")["data"]["collector.yaml"])
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{grpc_port}")
    for c in pagedserve_containers(objects):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://pagedserve-otel-collector:{grpc_port}"
        assert env["OTEL_SERVICE_NAME"] == f"pagedserve-{c['name']}"


# ---------------------------------------------------------------- container build files

@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_run_pagedserve_as_the_manifests_user(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    final = text.split("\nFROM ")[-1]  # the stage that becomes the image
    assert re.search(rf"^USER {UID}(:{UID})?$", final, re.M)
    assert 'ENTRYPOINT ["pagedserve"]' in final
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", final, re.M) for p in line.split()}
    assert exposed == {50051, 50052, 50053}
    # A build from the repository root copies the packages that pyproject.toml installs.
    packages = {p.split(".")[0] for p in
                re.search(r'packages = \[(.*?)\]', (ROOT / "pyproject.toml").read_text()).group(1)
                .replace('"', "").replace(" ", "").split(",")}
    assert packages <= set(re.findall(r"^COPY (\S+) ", text, re.M))
    ignore = (DEPLOY / f"{dockerfile}.dockerignore").read_text()
    assert ignore == (DEPLOY / "Dockerfile.cpu.dockerignore").read_text()
