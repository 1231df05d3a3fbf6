"""deploy/: closed by default, and executors that scale and drain. On the rendered overlays
(the loader of test_deploy_manifests): every internal port is behind a NetworkPolicy that
admits only its callers; every internal service requires mutual TLS with peer roles, from
certificates whose roles (deploy/cert-manager) match what each container may call, and so
starts closed (pagedserve.rpc.internal_auth) without a shared token; the API
key comes from a Secret; the executor scales on its own metrics (which pagedserve exports
and the Prometheus adapter's rules name) and drains before its pod goes; a gateway pod's
grace period covers its preStop and its drain."""
from __future__ import annotations

import pytest
import yaml

from tests.unit.deploy.test_deploy_manifests import (DEPLOY, KUBE, OVERLAYS, kustomize,
                                                     pagedserve_containers, parse_container, workload)
from tests.support import REPO

GATEWAY = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "gateway"}
INGRESS_NAMESPACE = {"kubernetes.io/metadata.name": "ingress-nginx"}
MONITORING_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return kustomize(KUBE / "overlays" / request.param)


def pods(objects):
    return [o for o in objects if "template" in o.get("spec", {})]


def selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def policies_for(objects, labels):
    return [p for p in objects if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], labels)]


def test_every_internal_port_is_covered_by_a_network_policy(objects):
    for workload_ in pods(objects):
        labels = workload_["spec"]["template"]["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        policies = policies_for(objects, labels)
        # Denied unless allowed: some policy selects the pod for Ingress with no rule at all.
        assert any(p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")
                   for p in policies), f"{component}: no default-deny policy"
        rules = [r for p in policies for r in p["spec"].get("ingress", [])]
        for c in workload_["spec"]["template"]["spec"]["containers"]:
            for port in c.get("ports", []):
                if port["name"].endswith("health"):  # kubelet only (from the node): no rule
                    assert not [r for r in rules if port["containerPort"] in
                                {x["port"] for x in r.get("ports", [])}], port
                    continue
                admitting = [r for r in rules if port["containerPort"] in {x["port"] for x in r.get("ports", [])}]
                assert admitting, f"{component} port {port['name']} is in no policy"
                peers = [peer for r in admitting for peer in r.get("from", [None])]
                assert None not in peers, f"{component} {port['name']}: a rule without `from` admits all"
                if port["name"] in ("memsvc", "executor"):  # only gateways, of this namespace
                    assert peers == [{"podSelector": {"matchLabels": GATEWAY}}], peers
                elif port["name"] in ("grpc", "http"):  # the public APIs: only the ingress
                    assert peers == [{"namespaceSelector": {"matchLabels": INGRESS_NAMESPACE}}], peers
                elif "metrics" in port["name"]:
                    assert peers == [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE}}], peers
                else:  # the collector's OTLP: pagedserve pods
                    assert peers == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pagedserve"}}}]


def certificates() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "cert-manager" / "certificates.yaml").read_text()) if d]
    return {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}


def tls_secret(objects, container: dict) -> str:
    """The Secret mounted where the container's --tls-cert lives."""
    args = parse_container(container)
    [mount] = [m for m in container["volumeMounts"] if args.tls_cert.startswith(m["mountPath"] + "/")]
    for w in pods(objects):
        for v in w["spec"]["template"]["spec"].get("volumes", []):
            if v["name"] == mount["name"] and "secret" in v and container in w["spec"]["template"]["spec"]["containers"]:
                return v["secret"]["secretName"]
    raise AssertionError(f"{container['name']}: no Secret behind {args.tls_cert}")


def test_every_internal_service_requires_mutual_tls_with_peer_roles(objects):
    from pagedserve.rpc.peer_auth import EXECUTOR_POLICY, MEMSVC_POLICY

    by_name = {c["name"]: c for c in pagedserve_containers(objects)}
    args = {name: parse_container(c) for name, c in by_name.items()}
    certs = certificates()
    roles = {}
    for name, a in args.items():
        # Certificate, key and CA: memsvc and the executor then require client certificates
        # signed by the CA, and check the callers' roles; clients verify the servers.
        assert a.tls_cert and a.tls_key and a.tls_ca, f"{name}: not mutual TLS"
        assert a.peer_roles is True, f"{name}: peer roles off"
        for path in (a.tls_cert, a.tls_key, a.tls_ca):
            assert path.rsplit("/", 1)[1] in ("tls.crt", "tls.key", "ca.crt")  # cert-manager's keys
        secret = tls_secret(objects, by_name[name])
        assert secret in certs, f"{name}: Secret {secret} is made by no Certificate"
        roles[name] = {u.removeprefix("spiffe://pagedserve/") for u in certs[secret]["uris"]}
        assert roles[name] == {name}, f"{name}'s certificate says {roles[name]}"
    # What each may call: the gateway memsvc's and the executor's methods but registration;
    # the executor registration only.
    memsvc_methods = {m for m, allowed in MEMSVC_POLICY.items() if roles["gateway"] & allowed}
    assert memsvc_methods == set(MEMSVC_POLICY) - {"/pagedserve.v1.MemoryManager/RegisterExecutor"}
    assert all(roles["gateway"] & allowed for allowed in EXECUTOR_POLICY.values())
    assert roles["executor"] & MEMSVC_POLICY["/pagedserve.v1.MemoryManager/RegisterExecutor"]
    assert not any(roles["executor"] & allowed for allowed in EXECUTOR_POLICY.values())
    # Clients dial by pod address (gateway) or 127.0.0.1 (executor): the servers'
    # certificates carry the name they expect instead.
    for client, servers in (("gateway", ("memsvc", "executor")), ("executor", ("memsvc",))):
        for server in servers:
            assert args[client].tls_server_name in certs[tls_secret(objects, by_name[server])]["dnsNames"]


def test_memsvc_and_the_executor_start_closed_by_mutual_tls(objects):
    """A memsvc or executor with neither internal token nor mutual TLS refuses to start
    (pagedserve.rpc.internal_auth): here mutual TLS closes them, never --insecure-internal."""
    from pagedserve.service_cmds import config_from
    from pagedserve.rpc.internal_auth import require_closed

    for c in pagedserve_containers(objects):
        if c["name"] != "gateway":
            config = config_from(c["name"], parse_container(c))
            assert not config.insecure_internal, c["name"]
            require_closed(c["name"], config.internal_token, config.tls, config.insecure_internal)


def test_the_api_key_comes_from_a_secret(objects):
    [gateway] = [c for c in pagedserve_containers(objects) if c["name"] == "gateway"]
    env = {e["name"]: e for e in gateway["env"]}
    assert set(env["PAGEDSERVE_API_KEY"]["valueFrom"]) == {"secretKeyRef"}
    assert "--api-key" not in " ".join(gateway["args"])


def test_executors_scale_on_their_own_metrics(objects):
    hpas = {o["spec"]["scaleTargetRef"]["kind"]: o for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
    assert hpas["Deployment"]["spec"]["scaleTargetRef"]["name"] == "pagedserve-gateway"
    if "StatefulSet" not in hpas:  # the cpu overlay: no Prometheus adapter on a dev cluster
        return
    hpa = hpas["StatefulSet"]["spec"]
    names = {m[m["type"].lower()]["metric"]["name"] for m in hpa["metrics"]}
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())["rules"]
    served = {r["name"]["as"]: r["seriesQuery"].split("{")[0] for kind in ("custom", "external")
              for r in adapter[kind]}
    assert names == set(served) == {"pagedserve_kv_cache_usage", "pagedserve_requests_waiting"}
    sources = "\n".join(p.read_text() for d in ("pagedserve/memsvc", "pagedserve/gateway") for p in (REPO / d).rglob("*.py"))
    for series in served.values():  # exported by pagedserve (names in code, or f-strings)
        assert f'"{series}"' in sources or series.startswith("pagedserve:num_requests_"), series


def test_an_executor_scaled_down_drains_before_its_pod_goes(objects):
    from pagedserve.executor.server import DRAIN_IDLE_S

    sts = workload(objects, "StatefulSet", "pagedserve-executor")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in sts["containers"]}
    executor = parse_container(by_name["executor"])
    assert executor.drain_timeout > 0
    assert "preStop" not in by_name["executor"].get("lifecycle", {}), "SIGTERM starts the drain at once"
    memsvc_wait = int(by_name["memsvc"]["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert memsvc_wait > executor.drain_timeout + DRAIN_IDLE_S, "the pool must outlive the drain"
    assert sts["terminationGracePeriodSeconds"] > memsvc_wait
    assert by_name["executor"]["readinessProbe"]["grpc"]["port"] == executor.health_port


def test_a_gateway_pod_drains_its_streams_within_its_grace_period(objects):
    from pagedserve.gateway.config import STOP_AFTER_DRAIN_S

    pod = workload(objects, "Deployment", "pagedserve-gateway")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "gateway"]
    gateway = parse_container(container)
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert gateway.drain_timeout > 0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + gateway.drain_timeout + STOP_AFTER_DRAIN_S, \
        "the kubelet's SIGKILL would cut streams that --drain-timeout lets finish"
