"""vLLM's router in docker-compose.yml, and its image (Dockerfile.router).

Without a Docker daemon: hadolint on the Dockerfile, the compose file through
a real compose parser, the router's command through vllm-router's own parser
and each replica's through pagedserve's. Then the real router binary runs the
compose command, its addresses moved to loopback, in front of two replicas
that speak the router's contract without a model (router_fakes.py): it
subscribes to both replicas' events and replays, spreads cold prompts over
them (the point of --router-temperature; at 0 they pile on one), keeps a
long prefix on the replica that holds it, and drops a draining replica
within the health-check window the compose file promises.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


from need import need
from router_fakes import FakeReplica, Router, free_port
from test_images import compose, hadolint

ROOT = Path(__file__).resolve().parents[2]
# The names the router reaches the replicas by; the GPU replicas alias them.
REPLICAS = {"replica-1": "gpu-replica-1", "replica-2": "gpu-replica-2"}
EVENTS, REPLAY = "5557", "5558"


def services() -> dict:
    return compose()["services"]


def router_command() -> list[str]:
    return services()["router"]["command"]


def values(args: list[str], flag: str) -> list[list[str]]:
    """The values after each occurrence of `flag`, up to the next flag."""
    found = []
    for i, arg in enumerate(args):
        if arg == flag:
            end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")),
                       len(args))
            found.append(args[i + 1:end])
    return found


def value(args: list[str], flag: str) -> str:
    (only,) = values(args, flag)
    (single,) = only
    return single


def with_value(args: list[str], flag: str, new: str) -> list[str]:
    i = args.index(flag)
    return [*args[:i + 1], new, *args[i + 2:]]


# -- the image -------------------------------------------------------------------------
def test_router_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint(), "--no-color", "--format", "json", "Dockerfile.router"],
                            cwd=ROOT, capture_output=True, text=True)
    assert json.loads(result.stdout or "[]") == []  # no error, no warning


def test_router_image_pins_the_router_the_tests_run():
    """The wheel the image installs is the version installed here, which these
    tests and tests/service/test_vllm_router.py exercise; non-root; healthy on /liveness."""
    text = (ROOT / "Dockerfile.router").read_text()
    pinned = re.search(r"^ARG VLLM_ROUTER_VERSION=(\S+)$", text, re.M)[1]
    assert '"vllm-router==${VLLM_ROUTER_VERSION}"' in text
    try:
        installed = importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        need(False, "vllm-router is not installed (pip install vllm-router)")
    assert pinned == installed
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert "HEALTHCHECK" in text and "/liveness" in text
    assert 'ENTRYPOINT ["vllm-router"]' in text
    assert services()["router"]["image"] == f"pagedserve-router:{pinned}"
    assert services()["router"]["build"]["dockerfile"] == "Dockerfile.router"


# -- the compose file ------------------------------------------------------------------
def test_the_router_is_the_default_load_balancer_and_nginx_a_profile():
    """The router behind the front on :8000 (deploy/nginx/front: the routes the
    router passes keys on to it, the rest to the replicas; test_router_front.py
    runs it), reached by nothing else; nginx alone a profile beside them."""
    router, front, nginx = services()["router"], services()["front"], services()["nginx"]
    assert "profiles" not in router and "profiles" not in front  # every profile
    assert "ports" not in router and list(map(str, router["expose"])) == ["8000"]
    assert front["ports"] == ["8000:8000"]
    assert front["environment"]["PAGEDSERVE_ROUTER"] == "router:8000"
    assert "./deploy/nginx/front:/etc/nginx/templates:ro" in str(front["volumes"])
    placeholders = set(re.findall(r"\$\{(\w+)\}", (ROOT / "deploy" / "nginx" / "front" /
                                                    "pagedserve-front.conf.template").read_text()))
    assert placeholders == set(front["environment"])
    assert nginx["profiles"] == ["nginx"]
    (nginx_port,) = nginx["ports"]
    assert not nginx_port.startswith("8000:")  # beside the router, never instead
    assert set(front["depends_on"]) == {"router", "replica-1", "replica-2", "gpu-replica-1",
                                        "gpu-replica-2"}
    for balancer in (router, nginx):
        assert set(balancer["depends_on"]) == {"replica-1", "replica-2", "gpu-replica-1",
                                               "gpu-replica-2"}
        assert all(d["required"] is False for d in balancer["depends_on"].values())


def test_the_router_reads_every_replicas_events_and_replay():
    """kv_aware with one event source and one replay source per replica, keyed
    by the very URL the router sends that replica's requests to."""
    command = router_command()
    assert value(command, "--policy") == "kv_aware"
    (workers,) = values(command, "--worker-urls")
    assert workers == [f"http://{name}:8000" for name in REPLICAS]
    sources = [s for (s,) in values(command, "--kv-event-source")]
    replays = [s for (s,) in values(command, "--kv-event-replay-source")]
    assert sources == [f"{url}=tcp://{name}:{EVENTS}" for url, name in zip(workers, REPLICAS)]
    assert replays == [f"{url}=tcp://{name}:{REPLAY}" for url, name in zip(workers, REPLICAS)]
    assert value(command, "--kv-event-model") == "smollm2-135m-instruct"
    assert float(value(command, "--router-temperature")) > 0  # cold prompts spread
    assert int(value(command, "--health-check-interval-secs")) <= 5
    assert (value(command, "--host"), value(command, "--port")) == ("0.0.0.0", "8000")


def test_vllm_router_parses_the_compose_command():
    from vllm_router.launch_router import parse_router_args

    args = parse_router_args(router_command())
    args._validate_router_args()
    assert args.policy == "kv_aware" and args.router_temperature == 32
    assert len(args.kv_event_source) == len(args.kv_event_replay_source) == len(REPLICAS)


def test_the_replicas_publish_where_the_router_reads():
    """Every replica (CPU and GPU) binds its events and replay on all
    interfaces at the ports the router connects to, with the empty topic, the
    block size the router assumes; pagedserve's own parser and config take it."""
    from service.cli import build_parser, expand_config, service_config_from_args

    router = router_command()
    block_size = int(value(router, "--kv-event-block-size"))
    parser = build_parser()
    for cpu, gpu in REPLICAS.items():
        for name in (cpu, gpu):
            replica = services()[name]
            assert {"5557", "5558"} <= set(map(str, replica["expose"]))
            args = parser.parse_args(expand_config(parser, replica["command"][1:]))
            assert args.kv_events_endpoint == f"tcp://*:{EVENTS}"
            assert args.kv_events_replay_endpoint == f"tcp://*:{REPLAY}"
            assert args.kv_events_topic == ""  # vllm-router 0.1.17 reads no other
            config = service_config_from_args(args).engine  # its checks pass
            assert config.block_size == block_size
        assert services()[gpu]["networks"]["default"]["aliases"] == [cpu]


# -- the router for real, on loopback ----------------------------------------------------
@contextmanager
def compose_router(tmp_path: Path, temperature: str | None = None):
    """The compose command's router in front of two FakeReplicas: each compose
    address moved to a loopback port, nothing else changed (but the log level,
    debug, and a temperature to compare with)."""
    command, replicas = router_command(), {}
    try:
        for name in REPLICAS:
            events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            replica = replicas[name] = FakeReplica(name, events=events, replay=replay)
            host_port = replica.url.removeprefix("http://")
            command = [arg.replace(f"{name}:8000", host_port)
                       .replace(f"tcp://{name}:{EVENTS}", events)
                       .replace(f"tcp://{name}:{REPLAY}", replay) for arg in command]
        assert not any("replica-" in arg for arg in command), command
        port = free_port()
        command = with_value(with_value(command, "--host", "127.0.0.1"), "--port", str(port))
        command = with_value(command, "--prometheus-host", "127.0.0.1")
        command = with_value(command, "--prometheus-port", str(free_port()))
        if temperature is not None:
            command = with_value(command, "--router-temperature", temperature)
        router = Router([*command, "--log-level", "debug"], tmp_path / "router.log", port)
        try:
            for replica in replicas.values():
                router.wait_for(rf"kv_index subscriber for {re.escape(replica.url)} rank0 on "
                                + re.escape(replica.publisher.endpoint))
            router.wait_for(r"Router ready")
            yield router, replicas
        finally:
            router.stop()
    finally:
        for replica in replicas.values():
            replica.close()


def indexed(router: Router, replicas: dict) -> None:
    """Waits until the router has taken in every batch the replicas published."""
    for replica in replicas.values():
        if replica.published:
            router.wait_for(rf"kv_index live sequence advanced source={re.escape(replica.url)} "
                            rf"rank=0 seq={replica.published - 1}\b")


def text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))


def test_cold_prompts_spread_and_prefixes_stay_home(tmp_path):
    rng = random.Random(39)
    with compose_router(tmp_path) as (router, replicas):
        # Sequential prompts on idle replicas, sharing only their first block
        # (the messages' JSON head): a coin toss each at temperature 32.
        cold = []
        for _ in range(24):
            cold.append(router.chat(text(rng, 300))[0])
            indexed(router, replicas)
        assert min(cold.count(name) for name in REPLICAS) >= 2, cold
        # A tenant's 1000-token system prompt returns to the replica holding it.
        for _ in range(4):
            system = text(rng, 1000)
            home, _ = router.chat("hello", system)
            indexed(router, replicas)
            for _ in range(4):
                where, cached = router.chat(text(rng, 40), system)
                assert where == home and cached >= 1000 - 2 * 16, (where, home, cached)
                indexed(router, replicas)


def test_at_temperature_zero_cold_prompts_pile_on_one_replica(tmp_path):
    """Why the compose file sets --router-temperature: without it, once one
    replica holds the messages' first block, every cold prompt is cheapest there."""
    rng = random.Random(40)
    with compose_router(tmp_path, temperature="0") as (router, replicas):
        cold = []
        for _ in range(12):
            cold.append(router.chat(text(rng, 300))[0])
            indexed(router, replicas)
        assert len(set(cold)) == 1, cold


def test_a_draining_replica_leaves_the_rotation(tmp_path):
    """/health 503 (draining): out within the compose file's health-check window
    (interval x failure threshold), then every request goes to the other one."""
    rng = random.Random(41)
    with compose_router(tmp_path) as (router, replicas):
        command = router_command()
        window = (int(value(command, "--health-check-interval-secs"))
                  * int(value(command, "--health-failure-threshold")))
        replicas["replica-1"].draining = True
        time.sleep(window + 3)
        served = [router.chat(text(rng, 300))[0] for _ in range(12)]
        assert served == ["replica-2"] * 12
