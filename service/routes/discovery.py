"""GET /get_server_info and /kv_event_sources: what vLLM's router asks each pod it
discovers (vllm-router --service-discovery) before it routes by KV events.

With static `--kv-event-source URL=ENDPOINT` flags the router knows every
replica's event endpoint in advance; pods found through the Kubernetes API
have addresses nobody knows in advance, so the router asks each pod instead
(checked against vllm-router 0.1.17, tests/deploy/test_router_helm.py):

    GET /get_server_info     {"instance_id": ..., "kv_block_size": 16}
    GET /kv_event_sources    {"0": {"endpoint": "tcp://*:5557",
                                    "replay_endpoint": "tcp://*:5558", "topic": "",
                                    "publisher": "zmq", "encoding": "msgpack",
                                    "schema_version": 1}}

keyed by data-parallel rank (one here). The router subscribes at the pod's own
IP where the endpoint says `*`. A server that publishes no events names no
source, and the router routes to it by load. /get_server_info is open like
/health. /kv_event_sources names the sockets that carry every tenant's prompt
tokens, so once keys are set it takes one (any key: a tenant's or an admin's;
service/guards/auth.py), unless --open-kv-event-sources: vllm-router sends its
own --api-key in place of the client's on render, /v1/responses and /tokenize,
so a router in Kubernetes holds no key, and its pods find the sources open
while a NetworkPolicy (the chart's) keeps the sockets to the router pods.
"""

from __future__ import annotations


from starlette.requests import Request
from starlette.responses import JSONResponse

from service.config import resolved_replica_id
from service.serving.state import ServiceState


async def server_info(request: Request) -> JSONResponse:
    state: ServiceState = request.app.state.service
    config = state.config
    return JSONResponse({"instance_id": resolved_replica_id(config.fleet),
                         "kv_block_size": config.engine.block_size})


async def kv_event_sources(request: Request) -> JSONResponse:
    engine = request.app.state.service.config.engine
    if engine.kv_events_endpoint is None:
        return JSONResponse({})
    source = {"endpoint": engine.kv_events_endpoint, "topic": engine.kv_events_topic,
              "publisher": "zmq", "encoding": "msgpack", "schema_version": 1}
    if engine.kv_events_replay_endpoint is not None:
        source["replay_endpoint"] = engine.kv_events_replay_endpoint
    return JSONResponse({"0": source})
