"""The Helm chart's router (router.enabled): vLLM's router in front of the
replicas, finding them through Kubernetes service discovery.

Rendered as test_helm.py renders the chart (helm-python-sdk) and validated
with kubernetes-validate in strict mode, off and on with each policy; its
command line goes through vllm-router's own parser. Then the real router runs
the rendered command against a fake Kubernetes API (router_fakes.py): it adds
exactly this release's server pods, asks the API for nothing the Role does
not grant, and, with kv_aware, asks each pod where it publishes its KV events
(GET /get_server_info, /kv_event_sources): a pod that does not answer is
routed by load, and a pod that answers (as pagedserve does,
service/routes/discovery.py) gets subscribed to.
"""

from __future__ import annotations

import re
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from need import need
from router_fakes import BLOCK, FakeKubernetes, FakeReplica, Router, free_port
from test_helm import (  # noqa: F401 (tools: the autouse fixture that needs helm's packages)
    CRD_KINDS, KUBE_VERSION, NAMESPACE, RELEASE, ci_values, render, tools,
)

FULLNAME = f"{RELEASE}-pagedserve"
ROUTER = f"{FULLNAME}-router"
POLICIES = ["kv_aware", "cache_aware", "consistent_hash", "round_robin"]
CHART = Path(__file__).resolve().parents[2] / "helm" / "pagedserve"


def with_router(policy: str = "cache_aware", **more) -> dict:
    return {"router": {"enabled": True, "policy": policy, **more}}


def named(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def router_container(docs: list[dict]) -> dict:
    (container,) = named(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"]
    return container


def server_container(docs: list[dict]) -> dict:
    (container,) = named(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"][
        "containers"]
    return container


def flag(args: list[str], name: str) -> list[str]:
    """The values after the flag, up to the next flag."""
    i = args.index(name)
    end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")), len(args))
    return args[i + 1:end]


def served_config(docs: list[dict]) -> dict:
    return yaml.safe_load(named(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])


# -- rendering ---------------------------------------------------------------------------
def test_off_by_default_the_plain_service_stays():
    docs = render()
    assert not [d for d in docs if d["metadata"]["name"] == ROUTER]
    assert not {"kv-events-endpoint", "kv-events-replay-endpoint"} & set(served_config(docs))
    assert [p["name"] for p in server_container(docs)["ports"]] == ["http"]


@pytest.mark.parametrize("values", [*POLICIES, "router-ci", "router+gpu-keda-redis"])
def test_every_object_validates_strict(values):
    import kubernetes_validate

    if values == "router-ci":
        values = yaml.safe_load((CHART / "ci" / "router-values.yaml").read_text())
    elif values == "router+gpu-keda-redis":
        values = {**ci_values(), **with_router("kv_aware")}
    else:
        values = with_router(values)
    docs = render(values)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role",
                 "RoleBinding"):
        assert (kind, ROUTER) in kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("policy", POLICIES)
def test_the_router_discovers_this_releases_server_pods(policy):
    """--service-discovery with the server pods' labels, their namespace and
    port, and per policy only the flags that policy reads."""
    docs = render(with_router(policy))
    args = router_container(docs)["args"]
    server_labels = named(docs, "Deployment", FULLNAME)["spec"]["selector"]["matchLabels"]
    assert dict(s.split("=", 1) for s in flag(args, "--selector")) == server_labels
    assert "--service-discovery" in args and "--worker-urls" not in args
    assert flag(args, "--service-discovery-namespace") == [NAMESPACE]
    assert flag(args, "--service-discovery-port") == [
        str(server_container(docs)["ports"][0]["containerPort"])]
    assert flag(args, "--policy") == [policy]
    assert ("--router-temperature" in args) == (policy == "kv_aware")
    assert ("--balance-abs-threshold" in args) == (policy == "cache_aware")
    # The router pods never match the servers' selector: it routes to servers only.
    router_labels = named(docs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    assert not server_labels.items() <= router_labels.items()


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_router_parses_the_rendered_args(policy):
    from vllm_router.launch_router import parse_router_args

    docs = render(with_router(policy, extraArgs=["--request-timeout-secs", "3600"]))
    args = parse_router_args(router_container(docs)["args"])
    args._validate_router_args()
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    assert args.selector == named(docs, "Service", FULLNAME)["spec"]["selector"]
    assert (args.policy, args.service_discovery_port, args.port) == (policy, 8000, 8000)
    assert args.request_timeout_secs == 3600
    if policy == "kv_aware":
        assert args.router_temperature == 32
    if policy == "cache_aware":
        assert (args.balance_abs_threshold, args.balance_rel_threshold) == (8, 1.5)


def test_the_router_may_watch_pods_and_nothing_else():
    docs = render(with_router())
    (rule,) = named(docs, "Role", ROUTER)["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = named(docs, "RoleBinding", ROUTER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": ROUTER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER,
                                    "namespace": NAMESPACE}]
    pod = named(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == ROUTER and pod["automountServiceAccountToken"] is True
    assert named(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"][
        "automountServiceAccountToken"] is False  # the servers still have no token


def test_probes_resources_service_and_disruption_budget():
    docs = render(with_router())
    container = router_container(docs)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["image"] == "pagedserve-router:0.1.17"
    pod_labels = named(docs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    service = named(docs, "Service", ROUTER)["spec"]
    assert service["selector"].items() <= pod_labels.items()
    assert [p["targetPort"] for p in service["ports"]] == ["http", "metrics"]
    pdb = named(docs, "PodDisruptionBudget", ROUTER)["spec"]
    assert pdb["selector"]["matchLabels"] == service["selector"]
    assert pdb["maxUnavailable"] == 1
    assert not [d for d in render(with_router(podDisruptionBudget={"enabled": False}))
                if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == ROUTER]


@pytest.mark.parametrize("policy", POLICIES)
def test_only_kv_aware_makes_the_replicas_publish_events(policy, tmp_path):
    """kv_aware: config.yaml binds the events and the replay on every
    interface, no topic, and `pagedserve serve` takes it; other policies: no events."""
    from service.cli import build_parser, expand_config, service_config_from_args

    docs = render(with_router(policy))
    config, ports = served_config(docs), server_container(docs)["ports"]
    if policy != "kv_aware":
        assert "kv-events-endpoint" not in config and len(ports) == 1
        return
    assert config["kv-events-endpoint"] == "tcp://*:5557"
    assert config["kv-events-replay-endpoint"] == "tcp://*:5558"
    assert "kv-events-topic" not in config
    assert {p["name"]: p["containerPort"] for p in ports} == {
        "http": 8000, "kv-events": 5557, "kv-replay": 5558}
    path = tmp_path / "config.yaml"
    path.write_text(named(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, ["--config", str(path)]))
    engine = service_config_from_args(args).engine
    assert (engine.kv_events_endpoint, engine.kv_events_topic) == ("tcp://*:5557", "")


def test_a_kv_events_topic_fails_with_kv_aware():
    import helm_python as helm

    values = {**with_router("kv_aware"),
              "server": {"config": {"model": "smollm2-135m-instruct", "kv-events-topic": "x"}}}
    with pytest.raises(helm.HelmError, match="reads only the empty topic"):
        render(values)


@pytest.mark.parametrize("router, where", [
    ({"policy": "power_of_two"}, "/router/policy"),
    ({"temperature": -1}, "/router/temperature"),
    ({"balanceRelThreshold": 0.5}, "/router/balanceRelThreshold"),
    ({"replicaCount": 0}, "/router/replicaCount"),
    ({"polcy": "kv_aware"}, "polcy"),
])
def test_the_schema_rejects_bad_router_values(router, where):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as exc:
        render({"router": {"enabled": True, **router}})
    assert where in str(exc.value)


def test_notes_point_at_the_router():
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        notes = chart.render(with_router("kv_aware"), name=RELEASE, namespace=NAMESPACE)[
            "pagedserve/templates/NOTES.txt"]
    assert f"port-forward svc/{ROUTER} 8000:8000" in notes
    assert "--policy kv_aware" in notes and "/readiness" in notes


# -- the rendered router against a fake Kubernetes API -------------------------------------
POD_IPS = ["127.0.0.2", "127.0.0.3"]


def loopback_aliases() -> None:
    for ip in POD_IPS:
        try:
            with socket.socket() as sock:
                sock.bind((ip, 0))
        except OSError:
            need(False, f"cannot bind {ip} (Linux routes all of 127/8 to loopback)")


@contextmanager
def discovering_router(tmp_path: Path, policy: str, routes=None):
    """The chart's router command (addresses moved to loopback) against a fake
    API that lists two server pods of this release, one of them not Ready
    (warming), a router pod and a server pod of another release; the two
    Ready servers are FakeReplicas on POD_IPS."""
    loopback_aliases()
    docs = render(with_router(policy))
    server_labels = named(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    router_labels = named(docs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    other = {**server_labels, "app.kubernetes.io/instance": "other"}
    port = free_port(POD_IPS[0])
    warming = FakeKubernetes.pod("server-warming", NAMESPACE, "127.0.0.6", server_labels)
    warming["status"]["conditions"][0]["status"] = "False"
    kube = FakeKubernetes([
        FakeKubernetes.pod("server-a", NAMESPACE, POD_IPS[0], server_labels),
        FakeKubernetes.pod("server-b", NAMESPACE, POD_IPS[1], server_labels), warming,
        FakeKubernetes.pod("router-x", NAMESPACE, "127.0.0.4", router_labels),
        FakeKubernetes.pod("other-server", NAMESPACE, "127.0.0.5", other)])
    replicas = []
    try:
        for ip in POD_IPS:
            events = f"tcp://{ip}:{free_port(ip)}" if routes else None
            replicas.append(FakeReplica(ip, host=ip, port=port, events=events,
                                        routes=routes(events) if routes else None))
        args = router_container(docs)["args"]
        api = free_port()
        for name, new in (("--host", "127.0.0.1"), ("--port", str(api)),
                          ("--service-discovery-port", str(port)),
                          ("--prometheus-host", "127.0.0.1"),
                          ("--prometheus-port", str(free_port()))):
            i = args.index(name)
            args = [*args[:i + 1], new, *args[i + 2:]]
        env = {"KUBECONFIG": str(kube.kubeconfig(tmp_path / "kubeconfig", NAMESPACE))}
        router = Router([*args, "--log-level", "debug"], tmp_path / "router.log", api, env)
        try:
            for pod in ("server-a", "server-b"):
                router.wait_for(rf"Adding pod: {pod} ")
            router.wait_for(r"Router ready")
            yield router, replicas, kube
        finally:
            router.stop()
    finally:
        for replica in replicas:
            replica.close()
        kube.close()


def test_the_rendered_router_adds_this_releases_servers_only(tmp_path):
    with discovering_router(tmp_path, "cache_aware") as (router, replicas, kube):
        answered = {router.chat(f"hello {i}")[0] for i in range(8)}
        assert answered <= set(POD_IPS) and answered
        log = router.text()
        for pod in ("server-warming", "router-x", "other-server"):
            assert f"Adding pod: {pod}" not in log
        # All it asked the API: pods of the namespace, with verbs the Role grants.
        assert kube.requests and all(method == "GET" for method, _ in kube.requests)
        assert {path.split("?")[0] for _, path in kube.requests} == {
            f"/api/v1/namespaces/{NAMESPACE}/pods"}
        used = {"watch" if "watch=true" in path else "list" for _, path in kube.requests}
        (rule,) = named(render(with_router()), "Role", ROUTER)["rules"]
        assert used == {"list", "watch"} and used <= set(rule["verbs"])


def test_kv_aware_in_discovery_needs_the_pods_to_name_their_event_sources(tmp_path):
    """A pod that answers neither (404): the router asked, found no event
    source, and routes by load alone ("unverified_identity", nothing credited)."""
    with discovering_router(tmp_path, "kv_aware") as (router, replicas, _):
        router.chat("x" * 200)
        for replica in replicas:
            assert {"/get_server_info", "/kv_event_sources"} <= set(replica.paths)
        router.wait_for(r'KV prefix decision outcome="unverified_identity"')
        assert "spawned subscriber" not in router.text()


def test_kv_aware_in_discovery_subscribes_to_pods_that_answer(tmp_path):
    """The shape the router reads (measured on 0.1.17): a pod naming its sources,
    bound on every interface, is subscribed to at its own IP, and a repeated
    prefix returns to the pod that holds it."""
    def routes(events: str) -> dict:
        port = events.rsplit(":", 1)[1]
        return {"/get_server_info": {"instance_id": events, "kv_block_size": BLOCK},
                "/kv_event_sources": {"0": {"endpoint": f"tcp://*:{port}", "topic": "",
                                            "publisher": "zmq", "encoding": "msgpack",
                                            "schema_version": 1}}}

    with discovering_router(tmp_path, "kv_aware", routes) as (router, replicas, _):
        for replica in replicas:
            router.wait_for(r"kv_index subscriber for \S+ rank0 on "
                            + re.escape(replica.publisher.endpoint))
        system = "s" * 800
        home, _ = router.chat("first", system)
        holder = next(r for r in replicas if r.name == home)
        router.wait_for(rf"kv_index live sequence advanced source=\S+ rank=0 "
                        rf"seq={holder.published - 1}\b")
        for i in range(4):
            where, cached = router.chat(f"again {i}", system)
            assert where == home and cached >= 800 - 2 * BLOCK
