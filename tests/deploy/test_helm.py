"""The Helm chart helm/pagedserve: it lints, renders valid Kubernetes objects,
and those objects do what the server's contract needs.

Rendering goes through helm-python-sdk (Helm v4's Go SDK over ctypes, no helm
binary) and every object is checked with kubernetes-validate in strict mode,
so a misspelt field fails here rather than at `kubectl apply`. The assertions
then read the rendered objects, not the templates: probes on the right paths,
a termination grace that outlasts the drain, KEDA replacing the HPA, the
in-chart Redis wired into the Secret, and so on.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from need import need

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagedserve"
CI_VALUES = CHART / "ci" / "gpu-keda-redis-values.yaml"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-pagedserve"
# The newest Kubernetes release whose schemas kubernetes-validate ships, and a
# released one (the official Python client, which follows each release, is at
# 37.x). Pinned, not "latest": a validator upgrade must not change on its own
# what this test checks.
KUBE_VERSION = "1.37"
# kubernetes-validate ships the built-in kinds only, no CRD schemas: these two
# are skipped by the validator on purpose and their key fields checked by hand
# below (test_scaled_object_*, test_service_monitor_*).
CRD_KINDS = frozenset({"ScaledObject", "ServiceMonitor"})
# The server's command line, as the image's contract fixes it.
SERVE_ARGS = ["serve", "--host", "0.0.0.0", "--port", "8000",
              "--config", "/etc/pagedserve/config.yaml"]


@pytest.fixture(autouse=True)
def tools():
    """Both packages come with the dev extra; without them nothing here runs."""
    need(importlib.util.find_spec("helm_python") is not None,
         "helm-python-sdk is not installed (pip install -e '.[dev]')")
    need(importlib.util.find_spec("kubernetes_validate") is not None,
         "kubernetes-validate is not installed (pip install -e '.[dev]')")


def ci_values() -> dict:
    """The GPU + KEDA + in-chart Redis + ServiceMonitor + PVC + keys values file."""
    return yaml.safe_load(CI_VALUES.read_text())


@functools.lru_cache(maxsize=None)
def _render(values_json: str) -> tuple[dict, ...]:
    """The rendered objects, parsed; NOTES.txt and empty templates left out."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return tuple(doc for path, text in sorted(manifests.items())
                 if path.endswith((".yaml", ".yml"))
                 for doc in yaml.safe_load_all(text) if doc)


def render(values: dict | None = None) -> list[dict]:
    """Every object `helm template` would print for these values: rendered once,
    handed out as copies so that a test may change what it gets."""
    return copy.deepcopy(list(_render(json.dumps(values or {}, sort_keys=True))))


def objects(docs: list[dict], kind: str) -> list[dict]:
    """Every object of this kind."""
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    """The one object of this kind (fails when there are none or several)."""
    (found,) = objects(docs, kind)
    return found


def server(docs: list[dict]) -> dict:
    """The server container of the Deployment."""
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env(container: dict) -> dict:
    """The container's env entries by name."""
    return {item["name"]: item for item in container.get("env", [])}


def secret_data(docs: list[dict]) -> dict:
    """The chart's Secret, decoded."""
    data = one(docs, "Secret")["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def served_config(docs: list[dict]) -> dict:
    """config.yaml of the ConfigMap, as `pagedserve serve --config` reads it."""
    return yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])


VALUE_SETS = {
    "default": None,
    "gpu-keda-redis": ci_values,
    # Branches the two above leave out: the CPU HPA, an external Redis beside
    # an existing Secret, an existing cache claim.
    "hpa-external": lambda: {
        "autoscaling": {"enabled": True}, "existingSecret": "my-keys",
        "redis": {"url": "rediss://:pw@redis.example:6380/0"},
        "modelCache": {"persistence": {"enabled": True, "existingClaim": "models"}},
    },
    # The rest: a Redis password only in the user's Secret, Redis on an
    # emptyDir, a cache claim with storageClassName "", the optional objects off.
    # Four GPUs per pod: the model split over them, /dev/shm in memory.
    "tensor-parallel": lambda: {"gpu": {"enabled": True, "count": 4}},
    "redis-own-secret": lambda: {
        "redis": {"enabled": True, "auth": {"existingSecret": "redis-auth"},
                  "persistence": {"enabled": False}},
        "modelCache": {"persistence": {"enabled": True, "storageClass": "-"}},
        "serviceAccount": {"create": False}, "podDisruptionBudget": {"enabled": False},
        "tests": {"enabled": False},
    },
}


def values_of(name: str) -> dict | None:
    """A fresh copy of the named value set (None: the chart's defaults)."""
    make = VALUE_SETS[name]
    return make() if make else None


# -- lint and validation ----------------------------------------------------------------
@pytest.mark.parametrize("values_file", [None, *sorted((CHART / "ci").glob("*.yaml"))],
                         ids=lambda path: path.name if path else "chart-defaults")
def test_chart_lints_strict(values_file):
    """helm lint --strict on the defaults and on each ci/ values file (chart-testing's):
    no warnings or errors; info notes such as "icon is recommended" pass."""
    import helm_python as helm

    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], json.dumps(report, indent=2)
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_validates_strict(name):
    """Each rendered object is valid for Kubernetes KUBE_VERSION, unknown fields rejected."""
    import kubernetes_validate

    docs = render(values_of(name))
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # no schema shipped: checked by hand below
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_crd_allow_list_hides_only_crds():
    """The skipped kinds are rendered, and the validator really has no schema for them."""
    import kubernetes_validate

    docs = render(ci_values())
    assert {doc["kind"] for doc in docs} >= CRD_KINDS
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field():
    """Guards the test above: strict mode must reject what the API server would."""
    import kubernetes_validate

    deployment = one(render(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


# -- the server's pod --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_probes_follow_the_contract(name):
    """Readiness on /health (warming and draining say 503); startup and liveness on /live."""
    container = server(render(values_of(name)))
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/live", "port": "http"}
    # Model loading may take minutes: production-stack's 15 s + 60 x 10 s.
    assert (startup["initialDelaySeconds"], startup["periodSeconds"],
            startup["failureThreshold"]) == (15, 10, 60)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_the_drain_fits_in_the_termination_grace(name):
    """SIGKILL comes after preStop sleep + shutdown-grace-seconds + the flush, never during."""
    docs = render(values_of(name))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = server(docs)
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) > 0
    grace = served_config(docs)["shutdown-grace-seconds"]
    assert pod["terminationGracePeriodSeconds"] > grace + int(sleep[1])
    # + 10: uvicorn's flush of the last responses (5 s) and a margin to exit.
    assert pod["terminationGracePeriodSeconds"] == math.ceil(grace) + int(sleep[1]) + 10


def test_a_fractional_grace_rounds_up():
    """The flag takes seconds as a float; the pod's grace is whole seconds, rounded up."""
    docs = render({"server": {"shutdownGraceSeconds": 30.5}})
    assert served_config(docs)["shutdown-grace-seconds"] == 30.5
    assert one(docs, "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 31 + 5 + 10


def test_the_pod_runs_non_root_and_read_only():
    """The image's uid 10001, no escalation, no capabilities, a read-only root."""
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    context = server(docs)["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001 == pod["securityContext"]["fsGroup"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    # With the root filesystem read-only, the writable places are volumes.
    mounts = {m["mountPath"]: m["name"] for m in server(docs)["volumeMounts"]}
    assert mounts == {"/etc/pagedserve": "config", "/cache": "cache", "/tmp": "tmp"}


def test_the_command_line_reads_the_config_map():
    """The contract's args, the ConfigMap at /etc/pagedserve, no secret in argv."""
    docs = render()
    container = server(docs)
    assert container["args"][:len(SERVE_ARGS)] == SERVE_ARGS
    assert "command" not in container  # the image's ENTRYPOINT: pagedserve
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    # No secret on the command line: keys and Redis URLs come through env.
    assert not any("key" in arg or "redis://" in arg for arg in container["args"])


@pytest.mark.parametrize("name", ["default", "gpu-keda-redis"])
def test_pagedserve_serve_accepts_the_config(name, tmp_path):
    """The real parser of `pagedserve serve` takes the rendered args and config.yaml."""
    from service.cli import build_parser, expand_config

    docs = render(values_of(name))
    config = tmp_path / "config.yaml"
    config.write_text(one(docs, "ConfigMap")["data"]["config.yaml"])
    # [1:]: past the "serve" subcommand; Kubernetes would fill in $(POD_IP).
    argv = [str(config) if arg == "/etc/pagedserve/config.yaml"
            else arg.replace("$(POD_IP)", "10.0.0.7") for arg in server(docs)["args"][1:]]
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, argv))
    assert args.shutdown_grace_seconds == served_config(docs)["shutdown-grace-seconds"]
    assert (args.host, args.port, args.advertise_url) == ("0.0.0.0", 8000, "http://10.0.0.7:8000")


def test_a_config_change_rolls_the_pods():
    """The checksum annotation follows config.yaml, and only it."""
    def checksum(values):
        """The Deployment's checksum/config for these values."""
        return one(render(values), "Deployment")["spec"]["template"]["metadata"][
            "annotations"]["checksum/config"]

    base = checksum(None)
    assert checksum({"server": {"config": {"max-model-len": 4096}}}) != base
    assert checksum({"server": {"shutdownGraceSeconds": 45}}) != base
    assert checksum({"replicaCount": 3}) == base  # not a config change: no roll for it


# -- GPU -------------------------------------------------------------------------------
def test_gpu_only_with_gpu_enabled():
    """The -cuda image, the GPU limit and the GPU taint's toleration come together."""
    cpu, gpu = server(render()), server(render(ci_values()))
    assert cpu["image"] == "pagedserve:0.1.0-cpu"
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert gpu["image"] == "pagedserve:0.1.0-cuda"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == ci_values()["gpu"]["count"]
    pod = one(render(ci_values()), "Deployment")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "tolerations" not in one(render(), "Deployment")["spec"]["template"]["spec"]


def test_several_gpus_split_the_model_and_get_shared_memory():
    """gpu.count > 1: tensor-parallel-size follows it, and NCCL gets a memory /dev/shm."""
    import helm_python as helm

    docs = render({"gpu": {"enabled": True, "count": 2}})
    assert served_config(docs)["tensor-parallel-size"] == 2
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [v for v in pod["volumes"] if v["name"] == "shm"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert {"name": "shm", "mountPath": "/dev/shm"} in server(docs)["volumeMounts"]
    for single in (render(), render(ci_values())):  # one GPU, or none: neither
        assert "tensor-parallel-size" not in served_config(single)
        volumes = one(single, "Deployment")["spec"]["template"]["spec"]["volumes"]
        assert "shm" not in [v["name"] for v in volumes]
    chosen = {"gpu": {"enabled": True, "count": 4},
              "server": {"config": {"tensor-parallel-size": 2}}}
    assert served_config(render(chosen))["tensor-parallel-size"] == 2
    too_many = {"gpu": {"enabled": True, "count": 2},
                "server": {"config": {"tensor-parallel-size": 4}}}
    with pytest.raises(helm.HelmError, match="needs 4 GPUs per pod, but gpu.count=2"):
        render(too_many)


def test_the_image_tag_follows_values():
    """repository and tag from values, the variant suffix still appended."""
    values = {"image": {"repository": "registry.example/pagedserve", "tag": "0.2.0"}}
    assert server(render(values))["image"] == "registry.example/pagedserve:0.2.0-cpu"


# -- scaling ---------------------------------------------------------------------------
def test_keda_replaces_the_hpa():
    """The CI values turn on both: KEDA wins, no second autoscaler fights it."""
    docs = render(ci_values())
    assert ci_values()["autoscaling"]["enabled"] is True
    assert not objects(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the autoscaler owns it


def test_scaled_object_scales_on_the_waiting_queue():
    """Hand check of the KEDA CRD (no schema for it in kubernetes-validate)."""
    scaled = one(render(ci_values()), "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": FULLNAME}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert "pagedserve:num_requests_waiting" in metadata["query"]
    assert f'namespace="{NAMESPACE}"' in metadata["query"]
    assert metadata["threshold"] == "5"  # KEDA reads trigger metadata as strings
    assert metadata["serverAddress"] == ci_values()["keda"]["serverAddress"]
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}


def test_the_cpu_hpa_without_keda():
    """autoscaling.enabled alone: an autoscaling/v2 HPA on CPU; off by default."""
    docs = render(values_of("hpa-external"))
    assert not objects(docs, "ScaledObject")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == FULLNAME
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu",
                                  "target": {"type": "Utilization", "averageUtilization": 80}}
    assert "replicas" not in one(docs, "Deployment")["spec"]
    assert not objects(render(), "HorizontalPodAutoscaler")  # off by default
    assert one(render(), "Deployment")["spec"]["replicas"] == 1


def test_rollouts_and_disruptions_keep_capacity():
    """maxUnavailable 0 in rollouts; the PDB's two forms select the server pods."""
    docs = render()
    rolling = one(docs, "Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
    assert pdb["selector"]["matchLabels"] == one(docs, "Service")["spec"]["selector"]
    ci_pdb = one(render(ci_values()), "PodDisruptionBudget")["spec"]
    assert ci_pdb["minAvailable"] == 1 and "maxUnavailable" not in ci_pdb


# -- secrets and the fleet -------------------------------------------------------------
def test_no_fleet_and_no_secret_by_default():
    """Neither redis.url nor redis.enabled: a lone server, nothing secret to hold."""
    docs = render()
    assert not objects(docs, "StatefulSet") and not objects(docs, "Secret")
    assert not {"PAGEDSERVE_REDIS_URL", "PAGEDSERVE_API_KEYS"} & set(env(server(docs)))


def test_the_in_chart_redis_is_wired_into_the_secret():
    """redis.enabled: the StatefulSet, its Services, and its URL in PAGEDSERVE_REDIS_URL."""
    docs = render(ci_values())
    redis = one(docs, "StatefulSet")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "redis:7"
    assert "--appendonly yes" in container["args"][0]
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "4Gi"}
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    services = {s["metadata"]["name"]: s["spec"] for s in objects(docs, "Service")}
    assert services[redis["spec"]["serviceName"]]["clusterIP"] == "None"
    password = ci_values()["redis"]["auth"]["password"]
    url = f"redis://:{password}@{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
    assert secret_data(docs)["redisUrl"] == url
    assert f"{FULLNAME}-redis" in services
    assert env(server(docs))["PAGEDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": FULLNAME, "key": "redisUrl"}
    assert env(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == FULLNAME


def test_api_keys_come_from_the_secret():
    """Keys reach the server as comma-joined env vars from the chart's Secret."""
    docs = render(ci_values())
    data = secret_data(docs)
    assert data["apiKeys"] == "ci-key-one,ci-key-two"
    assert data["adminKeys"] == "ci-admin-key"
    refs = env(server(docs))
    assert refs["PAGEDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "apiKeys"
    assert refs["PAGEDSERVE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "adminKeys"
    assert "checksum/secret" in one(docs, "Deployment")["spec"]["template"]["metadata"][
        "annotations"]


def test_an_existing_secret_and_an_external_redis():
    """existingSecret supplies the keys; the chart's Secret holds only the URL it knows."""
    docs = render(values_of("hpa-external"))
    assert not objects(docs, "StatefulSet")
    assert secret_data(docs) == {"redisUrl": "rediss://:pw@redis.example:6380/0"}
    refs = env(server(docs))
    assert refs["PAGEDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "my-keys"
    assert refs["PAGEDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == FULLNAME
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "models"}} in volumes
    assert not objects(docs, "PersistentVolumeClaim")


def test_a_redis_password_from_an_existing_secret_never_reaches_the_chart():
    """The URL is spliced together by Kubernetes from the user's Secret."""
    docs = render(values_of("redis-own-secret"))
    assert not objects(docs, "Secret")
    refs = env(server(docs))
    assert refs["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-auth", "key": "redis-password"}
    # Kubernetes splices $(REDIS_PASSWORD) in: the variable is defined above it.
    assert refs["PAGEDSERVE_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")


# -- monitoring --------------------------------------------------------------------------
def test_service_monitor_scrapes_metrics():
    """Hand check of the Prometheus Operator CRD (no schema in kubernetes-validate)."""
    docs = render(ci_values())
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    service = next(s for s in objects(docs, "Service") if s["metadata"]["name"] == FULLNAME)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert not objects(render(), "ServiceMonitor")


# -- values: the schema and the README -------------------------------------------------
@pytest.mark.parametrize("values, where", [
    ({"replicaCount": -1}, "/replicaCount"),
    ({"replicaCount": "two"}, "/replicaCount"),
    ({"replicaCont": 2}, "replicaCont"),  # a typo is an error, not a silent default
    ({"server": {"shutdownGraceSeconds": "30s"}}, "/server/shutdownGraceSeconds"),
    ({"server": {"config": {"host": "127.0.0.1"}}}, "'host'"),  # the probes need 0.0.0.0
    ({"server": {"config": {"api-key": "sk-1"}}}, "'api-key'"),  # secrets stay out of ConfigMaps
    ({"apiKeys": ["a,b"]}, "/apiKeys/0"),  # commas separate keys in the env var
    ({"keda": {"minReplicas": 0}}, "/keda/minReplicas"),
    ({"redis": {"url": "http://redis:6379"}}, "/redis/url"),
    ({"redis": {"auth": {"password": "p@ss word"}}}, "/redis/auth/password"),
])
def test_the_schema_rejects_bad_values(values, where):
    """values.schema.json fails the render, naming the offending value."""
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as exc:
        render(values)
    assert where in str(exc.value)


def documented_paths(values: dict, schema: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the values a user sets: the schema's closed objects are
    opened up, and open maps (resources.limits, podSecurityContext) are one value."""
    paths = []
    for key, value in values.items():
        node = schema["properties"][key]
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            paths += documented_paths(value, node, f"{prefix}{key}.")
        else:
            paths.append(f"{prefix}{key}")
    return paths


def test_the_readme_documents_every_value():
    """Each value of values.yaml has a row in the README's table."""
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing = [p for p in documented_paths(values, schema) if f"| `{p}` |" not in readme]
    assert not missing, f"helm/pagedserve/README.md has no table row for: {missing}"


def test_notes_tell_how_to_reach_the_server():
    """NOTES.txt: port-forward, /health, and a chat completion with the key."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        notes = chart.render(ci_values(), name=RELEASE, namespace=NAMESPACE)[
            "pagedserve/templates/NOTES.txt"]
    assert f"port-forward svc/{FULLNAME} 8000:8000" in notes
    assert "curl -i http://127.0.0.1:8000/health" in notes
    assert "/v1/chat/completions" in notes and "Authorization: Bearer $API_KEY" in notes
    assert '"model": "smollm2-135m-instruct"' in notes
