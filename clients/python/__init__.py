"""pagedserve's Python client: `Client`, `AsyncClient`, typed answers and errors.

    from clients.python import Client
    with Client("http://127.0.0.1:8000") as client:
        for text in client.chat_stream([{"role": "user", "content": "Hello"}]):
            print(text, end="", flush=True)
"""

from clients.python.client import AsyncClient, Client
from clients.python.errors import (
    APIError, AuthenticationError, BadRequestError, ConnectionError, NotFoundError,
    RateLimitError, ServiceUnavailableError, StreamError,
)
from clients.python.streams import AsyncTextStream, TextStream
from clients.python.types import (
    ChatCompletion, Completion, Embedding, Embeddings, Health, Model, Rerank, RerankResult, Usage,
)

__all__ = [
    "APIError", "AsyncClient", "AsyncTextStream", "AuthenticationError", "BadRequestError",
    "ChatCompletion", "Client", "Completion", "ConnectionError", "Embedding", "Embeddings",
    "Health", "Model", "NotFoundError", "RateLimitError", "Rerank", "RerankResult",
    "ServiceUnavailableError", "StreamError", "TextStream", "Usage",
]
