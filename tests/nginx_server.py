"""Debian's nginx on a free loopback port, running the load balancer's own
configuration (deploy/nginx/templates/pagedserve.conf.template, the file
docker-compose.yml mounts) in front of replicas on loopback ports.

The template is rendered as the official nginx image renders it at start
(bench/fleet/routing_fronts.py nginx_command, which the routing benchmark runs too):
${NAME} placeholders from the environment, nginx's own $variables untouched,
and a top-level file with what the image's /etc/nginx/nginx.conf has (events,
temp paths). Here it adds an access log that names the replica that served
each request, so tests can tell where a request went.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common.replicas import stop_process
from bench.fleet.routing_fronts import NGINX_TEMPLATE, nginx_binary, nginx_command
from live_server import accepts, free_port
from need import need

# The log line that names the replica that served each request (served_by).
ACCESS_LOG = """log_format lb '$http_x_test_id $status "$upstream_addr" "$upstream_status"';
    access_log {dir}/access.log lb;"""


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
        stop_process(self.process, 10)


def start_nginx(folder: Path, replicas: list[str], template: Path = NGINX_TEMPLATE,
                **values: str) -> Nginx:
    """nginx running `template` (the load balancer's, or the router's front with its
    PAGEDSERVE_ROUTER in `values`) in front of `replicas` (host:port)."""
    binary = nginx_binary()
    need(binary is not None, "nginx is not installed (apt-get install nginx)")
    port = free_port()
    command = nginx_command(binary, folder, replicas, port, ACCESS_LOG.format(dir=folder),
                            template, **values)
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nginx did not start: {(folder / 'error.log').read_text()}")
        time.sleep(0.02)
    return Nginx(folder, port, process)

