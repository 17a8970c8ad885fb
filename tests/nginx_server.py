"""Debian's nginx on a free loopback port, running the load balancer's own
configuration (deploy/nginx/templates/pagedserve.conf.template, the file
docker-compose.yml mounts) in front of replicas on loopback ports.

The template is rendered as the official nginx image renders it at start:
${NAME} placeholders from the environment, nginx's own $variables untouched.
A test-only top-level file adds what the image's /etc/nginx/nginx.conf has
(events, temp paths) and an access log that names the replica that served
each request, so tests can tell where a request went.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from live_server import accepts, free_port
from need import need

TEMPLATE = (Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "templates"
            / "pagedserve.conf.template")

TOP_LEVEL = """
{user}
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format lb '$http_x_test_id $status "$upstream_addr" "$upstream_status"';
    access_log {dir}/access.log lb;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/pagedserve.conf;
}}
"""


def render(replicas: list[str], listen: str) -> str:
    """The template with the environment the compose file gives the nginx image."""
    env = {"PAGEDSERVE_REPLICA_1": replicas[0], "PAGEDSERVE_REPLICA_2": replicas[1],
           "PAGEDSERVE_LISTEN": listen}
    text = TEMPLATE.read_text()
    # envsubst replaces only the variables it is given: so does safe_substitute.
    return string.Template(text).safe_substitute(env)


@dataclass
class Nginx:
    folder: Path
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def served_by(self) -> dict[str, tuple[str, str]]:
        """Test id -> (upstream addresses tried, their statuses), from the access log."""
        log = self.folder / "access.log"
        rows = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            match = re.fullmatch(r'(\S+) \d+ "([^"]*)" "([^"]*)"', line)
            if match:
                rows[match[1]] = (match[2], match[3])
        return rows

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_nginx(folder: Path, replicas: list[str]) -> Nginx:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                       else None)
    need(binary is not None, "nginx is not installed (apt-get install nginx)")
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pagedserve.conf").write_text(render(replicas, f"127.0.0.1:{port}"))
    user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the temp dirs
    conf = folder / "nginx.conf"
    conf.write_text(TOP_LEVEL.format(dir=folder, user=user))
    error_log = str(folder / "startup.log")  # before the configuration's own log opens
    check = subprocess.run([binary, "-t", "-c", str(conf), "-p", str(folder), "-e", error_log],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    process = subprocess.Popen([binary, "-c", str(conf), "-p", str(folder), "-e", error_log,
                                "-g", "daemon off;"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nginx did not start: {(folder / 'error.log').read_text()}")
        time.sleep(0.02)
    return Nginx(folder, port, process)

