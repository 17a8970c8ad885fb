"""Who can reach the replicas' KV event and replay sockets (issue #57, finding 6):
they carry every tenant's prompt tokens and take no credentials, so the
deployments keep them to the router.

Helm: while the replicas publish (router.policy=kv_aware, or an endpoint in
server.config), a NetworkPolicy on the server pods admits only the router pods
(or networkPolicy.kvEventClients) to the event and replay ports and anyone to
the API port. The policy is read here as a network plugin reads it (`admits`),
so the test says who gets in, not how the YAML is spelt. Compose: the events
are `expose`d on the compose network, never published on the host.
"""

from __future__ import annotations

import pytest

from test_helm import KUBE_VERSION, NAMESPACE, render, tools  # noqa: F401 (the autouse fixture)
from test_router_compose import services
from test_router_helm import FULLNAME, ROUTER, named, served_config, server_container, with_router

POLICY = f"{FULLNAME}-kv-events"
EVENT_FLAGS = ("kv-events-endpoint", "kv-events-replay-endpoint")


def policies(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for rule in selector.get("matchExpressions", []):
        key, op, values = rule["key"], rule["operator"], rule.get("values", [])
        if not {"In": key in labels and labels[key] in values,
                "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def admits(docs: list[dict], labels: dict, port: int, namespace: str = NAMESPACE,
           namespace_labels: dict | None = None) -> bool:
    """Whether a pod with `labels` in `namespace` may open `port` on a server pod,
    by the rendered NetworkPolicies that select the server pods (none: open)."""
    server_labels = named(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    named_ports = {p["name"]: p["containerPort"] for p in server_container(docs)["ports"]}
    selecting = [p["spec"] for p in policies(docs)
                 if matches(p["spec"]["podSelector"], server_labels)]
    if not selecting:
        return True

    def peer_admits(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            in_namespace = matches(peer["namespaceSelector"], namespace_labels or {})
        else:
            in_namespace = namespace == NAMESPACE
        return in_namespace and matches(peer.get("podSelector", {}), labels)

    for spec in selecting:
        for rule in spec.get("ingress", []):
            ports = {named_ports.get(p["port"], p["port"]) for p in rule.get("ports", [])}
            if (not ports or port in ports) and (
                    "from" not in rule or any(peer_admits(peer) for peer in rule["from"])):
                return True
    return False


def pod_labels(docs: list[dict], name: str) -> dict:
    return named(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def event_ports(docs: list[dict]) -> list[int]:
    config = served_config(docs)
    return [int(config[flag].rsplit(":", 1)[1]) for flag in EVENT_FLAGS]


# -- Helm ----------------------------------------------------------------------------------
def test_kv_aware_keeps_the_event_ports_to_the_router_pods():
    docs = render(with_router("kv_aware"))
    router, server = pod_labels(docs, ROUTER), pod_labels(docs, FULLNAME)
    ports = event_ports(docs)
    assert ports == [5557, 5558]
    assert {p["containerPort"] for p in server_container(docs)["ports"]} >= set(ports)
    for port in ports:
        assert admits(docs, router, port)
        assert not admits(docs, server, port)  # another replica
        assert not admits(docs, {"app": "curious-tenant"}, port)
        assert not admits(docs, router, port, namespace="elsewhere")  # same labels, wrong place
    for labels in (router, server, {"app": "curious-tenant"}):
        assert admits(docs, labels, 8000)  # the API stays open to all
    (policy,) = policies(docs)
    assert policy["metadata"]["name"] == POLICY and policy["spec"]["policyTypes"] == ["Ingress"]
    assert not matches(policy["spec"]["podSelector"], router)  # the router pods stay open


def test_the_policy_follows_the_endpoints_and_the_chosen_readers():
    """Ports from server.config's endpoints; readers from networkPolicy.kvEventClients,
    which then replace the router pods; strict validation of what that renders."""
    import kubernetes_validate

    indexer = {"app": "indexer"}
    values = {**with_router("kv_aware"), "server": {"config": {
        "model": "smollm2-135m-instruct", "kv-events-endpoint": "tcp://*:6000",
        "kv-events-replay-endpoint": "tcp://0.0.0.0:6001"}},
        "networkPolicy": {"kvEventClients": {
            "podSelector": {"matchLabels": indexer,
                            "matchExpressions": [{"key": "tier", "operator": "NotIn",
                                                  "values": ["web"]}]},
            "namespaceSelector": {"matchLabels": {"team": "routing"}}}}}
    docs = render(values)
    team = {"team": "routing"}
    for port in (6000, 6001):
        assert admits(docs, indexer, port, "routing", team)
        assert not admits(docs, {**indexer, "tier": "web"}, port, "routing", team)
        assert not admits(docs, indexer, port, "other", {"team": "other"})
        assert not admits(docs, pod_labels(docs, ROUTER), port)
    assert not admits(docs, indexer, 5557, "routing", team)  # nothing listens there now
    for doc in policies(docs):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_events_published_without_the_router_are_kept_to_it_too():
    """An endpoint in server.config alone publishes too: the policy is there,
    admitting this release's router pods (none run) unless readers are named."""
    docs = render({"server": {"config": {"model": "smollm2-135m-instruct",
                                         "kv-events-endpoint": "tcp://*:5557"}}})
    (policy,) = policies(docs)
    (events_rule,) = [rule for rule in policy["spec"]["ingress"] if "from" in rule]
    assert [p["port"] for p in events_rule["ports"]] == [5557]
    assert not admits(docs, {"app": "curious-tenant"}, 5557)


@pytest.mark.parametrize("values", [
    None, with_router("cache_aware"), with_router("round_robin"),
    {**with_router("kv_aware"), "networkPolicy": {"enabled": False}},
    {"server": {"config": {"model": "m", "kv-events-endpoint": "ipc:///tmp/events"}}},
], ids=["defaults", "cache_aware", "round_robin", "disabled", "ipc-endpoint"])
def test_no_tcp_events_no_policy(values):
    """Nothing published on TCP, or the policy turned off: no NetworkPolicy (one
    would close the pods' other ports for nothing)."""
    assert not policies(render(values))


def test_the_router_finds_the_sources_without_a_key():
    """kv_aware: the pods answer /kv_event_sources without a key (the router holds
    none), and `pagedserve serve` reads the chart's flag so."""
    from service.cli import build_parser, expand_config, service_config_from_args

    config = served_config(render(with_router("kv_aware")))
    assert config["open-kv-event-sources"] is True
    parser = build_parser()
    argv = [arg for flag, value in config.items()
            for arg in ([f"--{flag}"] if value is True else [f"--{flag}", str(value)])]
    assert service_config_from_args(parser.parse_args(expand_config(parser, argv))
                                    ).open_kv_event_sources is True
    assert "open-kv-event-sources" not in served_config(render(with_router("cache_aware")))


def test_the_schema_rejects_a_misspelt_selector():
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as exc:
        render({"networkPolicy": {"kvEventClients": {"podSelector": {"matchLabel": {}}}}})
    assert "matchLabel" in str(exc.value)


# -- compose -------------------------------------------------------------------------------
def published(entry) -> tuple[str, str]:
    """(host port, container port) of a compose `ports` entry, short or long syntax."""
    if isinstance(entry, dict):
        return str(entry.get("published", "")), str(entry["target"])
    parts = str(entry).split("/")[0].split(":")
    return (parts[-2] if len(parts) > 1 else ""), parts[-1]


def test_compose_never_publishes_the_event_ports():
    """The replicas `expose` the events to the compose network (the router reads
    them there) and publish nothing; no service maps 5557 or 5558 onto the host."""
    found = services()
    for name, service in found.items():
        for host, container in map(published, service.get("ports", [])):
            assert not {host, container} & {"5557", "5558"}, (name, host, container)
    for name in ("replica-1", "replica-2", "gpu-replica-1", "gpu-replica-2"):
        assert "ports" not in found[name], name
        assert {"5557", "5558"} <= set(map(str, found[name]["expose"]))
