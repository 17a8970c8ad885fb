"""Client and AsyncClient: the server's API from Python, streaming included.

    client = Client("http://127.0.0.1:8000", api_key="...")
    print(client.chat([{"role": "user", "content": "Hi"}]).text)
    stream = client.chat_stream([{"role": "user", "content": "Hi"}])
    for text in stream:                  # text deltas, as they arrive
        print(text, end="", flush=True)
    print(stream.usage)                  # after the last one

A request the server refuses for now (429 queue full, 503 warming or
draining) is sent again after the server's Retry-After, or a backoff, up to
`max_retries` times; a refusal always comes before any token, so a stream
that produced text is never sent twice. Breaking out of a stream, or closing
it, closes the connection, and the server aborts the request.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
from typing import Any

import httpx
import msgspec

from clients.python.errors import ConnectionError, error_from
from clients.python.streams import AsyncTextStream, TextStream
from clients.python.types import (
    ChatCompletion, Completion, Embeddings, Health, ModelList, Rerank,
)

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})
BACKOFF_SECONDS = (0.5, 8.0)  # first wait, longest wait (doubling between)
MAX_RETRY_AFTER = 60.0  # a Retry-After longer than this is not waited out


def retry_delay(response: httpx.Response | None, attempt: int) -> float:
    """The server's Retry-After (seconds), else an exponential backoff."""
    if response is not None:
        value = response.headers.get("retry-after", "")
        if value.isdigit():
            return min(float(value), MAX_RETRY_AFTER)
    return min(BACKOFF_SECONDS[0] * 2**attempt, BACKOFF_SECONDS[1])


class _Settings:
    """What both clients share: where, who, how patient, and the request bodies."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float,
                 max_retries: int, model: str | None, session_id: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.retries = 0  # requests sent again after a refusal, over this client's life
        self.model = model
        self.headers = {"Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        if session_id:  # keeps a conversation on one replica behind the load balancer
            self.headers["X-Session-ID"] = session_id
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))

    def body(self, stream: bool, params: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = {**fields, **{k: v for k, v in params.items() if v is not None}}
        if self.model and "model" not in body:
            body["model"] = self.model
        if stream:
            body["stream"] = True
            body.setdefault("stream_options", {"include_usage": True})
        return body

    def embed_body(self, input, params: dict[str, Any]) -> dict[str, Any]:
        """An embeddings body: base64 on the wire unless asked otherwise (a quarter of
        the bytes of JSON numbers, as the openai SDK does), decoded by `embeddings`."""
        params = {"encoding_format": "base64", **params}
        return self.body(False, params, input=input)

    def rerank_body(self, query: str, documents: list[str], top_n: int | None,
                    params: dict[str, Any]) -> dict[str, Any]:
        return self.body(False, {"top_n": top_n, **params}, query=query, documents=documents)

    def use_session(self, session_id: str | None) -> None:
        """Send X-Session-ID from now on (None: stop sending it)."""
        if session_id:
            self.http.headers["X-Session-ID"] = session_id
        else:
            self.http.headers.pop("X-Session-ID", None)

    def should_retry(self, response: httpx.Response | None, attempt: int) -> bool:
        refused = response is None or response.status_code in RETRY_STATUSES
        return refused and attempt < self.max_retries


class Client(_Settings):
    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *,
                 timeout: float = 600.0, max_retries: int = 2, model: str | None = None,
                 session_id: str | None = None) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, model, session_id)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers,
                                 timeout=self.timeout)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- the API ---------------------------------------------------------------------
    def chat(self, messages: list[dict], **params: Any) -> ChatCompletion:
        body = self.body(False, params, messages=messages)
        return msgspec.json.decode(self._read(self._post("/v1/chat/completions", body)),
                                   type=ChatCompletion)

    def chat_stream(self, messages: list[dict], **params: Any) -> TextStream:
        body = self.body(True, params, messages=messages)
        return TextStream(self._post("/v1/chat/completions", body), chat=True)

    def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        body = self.body(False, params, prompt=prompt)
        return msgspec.json.decode(self._read(self._post("/v1/completions", body)),
                                   type=Completion)

    def complete_stream(self, prompt: str | list[int], **params: Any) -> TextStream:
        body = self.body(True, params, prompt=prompt)
        return TextStream(self._post("/v1/completions", body), chat=False)

    def embed(self, input: str | list[str] | list[int] | list[list[int]],
              **params: Any) -> Embeddings:
        """Embeddings of a text, texts or token ids (a server with --runner pooling).

        `params`: dimensions, normalize, truncate_prompt_tokens, ... as the server
        takes them. Each embedding comes back as a list of floats.
        """
        body = self.embed_body(input, params)
        return embeddings(self._read(self._post("/v1/embeddings", body)))

    def rerank(self, query: str, documents: list[str], top_n: int | None = None,
               **params: Any) -> Rerank:
        """The documents by relevance to the query, best first (the first top_n)."""
        body = self.rerank_body(query, documents, top_n, params)
        return msgspec.json.decode(self._read(self._post("/v1/rerank", body)), type=Rerank)

    def models(self) -> list:
        return msgspec.json.decode(self._read(self._get("/v1/models")), type=ModelList).data

    def health(self) -> Health:
        """The readiness answer, 200 or 503 alike (503 is an answer, not an error)."""
        response = self.http.get("/health")
        return msgspec.json.decode(response.content, type=Health)

    # -- plumbing ---------------------------------------------------------------------
    def _get(self, path: str) -> httpx.Response:
        return self._send(lambda: self.http.build_request("GET", path))

    def _post(self, path: str, body: dict) -> httpx.Response:
        return self._send(lambda: self.http.build_request("POST", path, json=body))

    def _send(self, build) -> httpx.Response:
        """The first answer that is not a refusal to retry; errors raised typed."""
        attempt = 0
        while True:
            try:
                response = self.http.send(build(), stream=True)
            except httpx.ConnectError as exc:  # nothing reached the server: safe to resend
                if not self.should_retry(None, attempt):
                    raise ConnectionError(0, f"cannot reach {self.base_url}: {exc}") from exc
                response = None
            if response is not None and response.status_code < 400:
                return response
            if response is not None and not self.should_retry(response, attempt):
                raise error_from(response.status_code, self._read(response))
            delay = retry_delay(response, attempt)
            if response is not None:
                response.close()
            time.sleep(delay)
            attempt += 1
            self.retries += 1

    @staticmethod
    def _read(response: httpx.Response) -> bytes:
        try:
            return response.read()
        finally:
            response.close()


class AsyncClient(_Settings):
    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *,
                 timeout: float = 600.0, max_retries: int = 2, model: str | None = None,
                 session_id: str | None = None, max_connections: int | None = None) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, model, session_id)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                      timeout=self.timeout, limits=limits)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def chat(self, messages: list[dict], **params: Any) -> ChatCompletion:
        body = self.body(False, params, messages=messages)
        data = await self._read(await self._post("/v1/chat/completions", body))
        return msgspec.json.decode(data, type=ChatCompletion)

    async def chat_stream(self, messages: list[dict], **params: Any) -> AsyncTextStream:
        body = self.body(True, params, messages=messages)
        return AsyncTextStream(await self._post("/v1/chat/completions", body), chat=True)

    async def complete(self, prompt: str | list[int], **params: Any) -> Completion:
        body = self.body(False, params, prompt=prompt)
        data = await self._read(await self._post("/v1/completions", body))
        return msgspec.json.decode(data, type=Completion)

    async def complete_stream(self, prompt: str | list[int], **params: Any) -> AsyncTextStream:
        body = self.body(True, params, prompt=prompt)
        return AsyncTextStream(await self._post("/v1/completions", body), chat=False)

    async def embed(self, input: str | list[str] | list[int] | list[list[int]],
                    **params: Any) -> Embeddings:
        """Embeddings of a text, texts or token ids (see Client.embed)."""
        body = self.embed_body(input, params)
        return embeddings(await self._read(await self._post("/v1/embeddings", body)))

    async def rerank(self, query: str, documents: list[str], top_n: int | None = None,
                     **params: Any) -> Rerank:
        """The documents by relevance to the query, best first (the first top_n)."""
        body = self.rerank_body(query, documents, top_n, params)
        data = await self._read(await self._post("/v1/rerank", body))
        return msgspec.json.decode(data, type=Rerank)

    async def models(self) -> list:
        data = await self._read(await self._send(lambda: self.http.build_request(
            "GET", "/v1/models")))
        return msgspec.json.decode(data, type=ModelList).data

    async def health(self) -> Health:
        response = await self.http.get("/health")
        return msgspec.json.decode(response.content, type=Health)

    async def _post(self, path: str, body: dict) -> httpx.Response:
        return await self._send(lambda: self.http.build_request("POST", path, json=body))

    async def _send(self, build) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self.http.send(build(), stream=True)
            except httpx.ConnectError as exc:
                if not self.should_retry(None, attempt):
                    raise ConnectionError(0, f"cannot reach {self.base_url}: {exc}") from exc
                response = None
            if response is not None and response.status_code < 400:
                return response
            if response is not None and not self.should_retry(response, attempt):
                raise error_from(response.status_code, await self._read(response))
            delay = retry_delay(response, attempt)
            if response is not None:
                await response.aclose()
            await asyncio.sleep(delay)
            attempt += 1
            self.retries += 1

    @staticmethod
    async def _read(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        finally:
            await response.aclose()


def embeddings(data: bytes) -> Embeddings:
    """An embeddings answer, each base64 embedding decoded to floats."""
    answer = msgspec.json.decode(data, type=Embeddings)
    for item in answer.data:
        if isinstance(item.embedding, str):
            item.embedding = floats(item.embedding)
    return answer


def floats(encoded: str) -> list[float]:
    """base64 of little-endian float32s (OpenAI's encoding) as floats."""
    values = array.array("f", base64.b64decode(encoded))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
