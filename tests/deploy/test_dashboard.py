"""The Grafana dashboard asks only for metrics a real server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from live_server import run_server, tiny_config
from redis_server import start_redis
from service.config import FleetConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pagedserve-dashboard.json"


def test_every_queried_metric_is_exported(tiny_llama_path, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"pagedserve:\w+", target["expr"])}
    assert len(queried) >= 15
    redis = start_redis(tmp_path)
    try:
        config = tiny_config(tiny_llama_path, fleet=FleetConfig(redis_url=redis.url))
        with run_server(config) as live:
            text = httpx.get(f"{live.url}/metrics", timeout=30).text
    finally:
        redis.kill()
    exported = set(re.findall(r"^(pagedserve:\w+)", text, re.M))
    assert queried - exported == set()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
