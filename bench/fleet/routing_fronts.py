"""The replicas and the load balancers in front of them, for `bench fleet --routing`.

    replicas = start_replicas(flags, 3, log_dir)    # pagedserve serve, each publishing
                                                    # KV events and their replay on loopback
    front = start_front("kv_aware", replicas, model_name, log_dir)
    ... traffic to front.url ...
    front.stop(); stop_replicas(replicas)

The fronts are the deployment's own: vllm-router from its wheel with the flags
docs/deployment.md gives (round_robin; cache_aware with its balance thresholds
8 and 1.5; kv_aware with temperature 32 and every replica's event and replay
source), and Debian's nginx running deploy/nginx/templates/pagedserve.conf.template
(consistent hash of X-Session-ID), its two `server` lines repeated for N replicas.
"""

from __future__ import annotations

import os
import shutil
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common.replicas import Replica, free_port, stop_process

MODES = ("round_robin", "nginx", "cache_aware", "kv_aware")
ROOT = Path(__file__).resolve().parents[2]
NGINX_TEMPLATE = ROOT / "deploy" / "nginx" / "templates" / "pagedserve.conf.template"
# What the nginx image's own nginx.conf adds around the template (tests/nginx_server.py
# runs it too, with an access log of its own).
NGINX_TOP_LEVEL = """
{user}
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    {access_log}
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/pagedserve.conf;
}}
"""
# Flags of every router, as docker-compose.yml runs it.
ROUTER_COMMON = ["--health-check-interval-secs", "5", "--health-failure-threshold", "2",
                 "--log-level", "info"]
POLICY_FLAGS = {
    "round_robin": ["--policy", "round_robin"],
    "cache_aware": ["--policy", "cache_aware", "--balance-abs-threshold", "8",
                    "--balance-rel-threshold", "1.5"],
    "kv_aware": ["--policy", "kv_aware", "--router-temperature", "32",
                 "--kv-event-block-size", "16"],
}


@dataclass
class EventReplica:
    """A replica and the loopback endpoints it binds for its KV events and their replay."""

    replica: Replica
    events: str
    replay: str

    @property
    def url(self) -> str:
        return self.replica.url


def start_replicas(flags: list[str], count: int, log_dir: Path, tag: str) -> list[EventReplica]:
    """`count` replicas started at once (the same flags, each its own ports); not waited on."""
    started = []
    for i in range(count):
        events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        own = flags + ["--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
        started.append(EventReplica(Replica.start(own, log_dir, f"{tag}-replica-{i}"),
                                    events, replay))
    return started


def stop_replicas(replicas: list[EventReplica]) -> None:
    for r in replicas:  # all told first, so that they drain side by side
        r.replica.process.terminate()
    for r in replicas:
        try:
            r.replica.process.wait(60)
        except subprocess.TimeoutExpired:
            r.replica.process.kill()
            r.replica.process.wait(10)


@dataclass
class Front:
    """A load balancer process on a loopback port."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        stop_process(self.process, 15)


def router_binary() -> str | None:
    found = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    return found if os.access(found, os.X_OK) else None


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                     else None)


def missing_tools(modes) -> list[str]:
    """The tools the modes need that are not installed, as install hints."""
    missing = []
    if any(m != "nginx" for m in modes) and router_binary() is None:
        missing.append("vllm-router (pip install vllm-router)")
    if "nginx" in modes and nginx_binary() is None:
        missing.append("nginx (apt-get install nginx)")
    return missing


def start_front(mode: str, replicas: list[EventReplica], model: str, log_dir: Path) -> Front:
    front = (start_nginx(replicas, log_dir / "nginx") if mode == "nginx"
             else start_router(mode, replicas, model, log_dir))
    wait_front(front)
    return front


def router_command(mode: str, replicas: list[EventReplica], model: str, port: int) -> list[str]:
    command = ["--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *(r.url for r in replicas), *POLICY_FLAGS[mode], *ROUTER_COMMON,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if mode == "kv_aware":
        command += ["--kv-event-model", model]
        for r in replicas:
            command += ["--kv-event-source", f"{r.url}={r.events}",
                        "--kv-event-replay-source", f"{r.url}={r.replay}"]
    return command


def start_router(mode: str, replicas: list[EventReplica], model: str, log_dir: Path) -> Front:
    binary = router_binary()
    if binary is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router)")
    port, log = free_port(), log_dir / f"router-{mode}.log"
    with log.open("wb") as out:
        process = subprocess.Popen([binary, *router_command(mode, replicas, model, port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    return Front(mode, f"http://127.0.0.1:{port}", process, log)


def render_nginx(template: str, replicas: list[str], listen: str, **values: str) -> str:
    """The template as the nginx image renders it, with one `server` line per replica
    in each upstream where the template names PAGEDSERVE_REPLICA_1 and _2; `values`
    fill its other placeholders (the front's PAGEDSERVE_ROUTER)."""
    lines = []
    for line in template.splitlines():
        server = line.strip().startswith("server ")
        if server and "${PAGEDSERVE_REPLICA_1}" in line:
            lines += [line.replace("${PAGEDSERVE_REPLICA_1}", r) for r in replicas]
        elif not (server and "${PAGEDSERVE_REPLICA_2}" in line):
            lines.append(line)
    # envsubst replaces only the variables it is given: so does safe_substitute.
    return string.Template("\n".join(lines) + "\n").safe_substitute(PAGEDSERVE_LISTEN=listen,
                                                                   **values)


def nginx_command(binary: str, folder: Path, hosts: list[str], port: int,
                  access_log: str = "access_log off;", template: Path = NGINX_TEMPLATE,
                  **values: str) -> list[str]:
    """Write the load balancer's configuration (`template`, for `hosts`, host:port)
    into `folder` and check it (`nginx -t`); the command that runs it in the foreground."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pagedserve.conf").write_text(
        render_nginx(template.read_text(), hosts, f"127.0.0.1:{port}", **values))
    user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the temp dirs
    conf = folder / "nginx.conf"
    conf.write_text(NGINX_TOP_LEVEL.format(dir=folder, user=user, access_log=access_log))
    # the startup log: before the configuration's own log opens
    base = [binary, "-c", str(conf), "-p", str(folder), "-e", str(folder / "startup.log")]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"nginx refused its configuration: {check.stderr}")
    return [*base, "-g", "daemon off;"]


def start_nginx(replicas: list[EventReplica], folder: Path) -> Front:
    binary = nginx_binary()
    if binary is None:
        raise SystemExit("nginx is not installed (apt-get install nginx)")
    port = free_port()
    hosts = [r.url.removeprefix("http://") for r in replicas]
    process = subprocess.Popen(nginx_command(binary, folder, hosts, port),
                               stderr=subprocess.DEVNULL)
    return Front("nginx", f"http://127.0.0.1:{port}", process, folder / "error.log")


def wait_front(front: Front, timeout: float = 60) -> None:
    """Until the front answers; a router until /readiness is 200 (a worker is healthy)."""
    path = "/health" if front.name == "nginx" else "/readiness"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if front.process.poll() is not None:
            raise RuntimeError(f"{front.name} exited with {front.process.returncode}; "
                               f"see {front.log}")
        try:
            if httpx.get(front.url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{front.name} did not answer {path} within {timeout} s; see {front.log}")
