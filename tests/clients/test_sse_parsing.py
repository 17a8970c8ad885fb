"""The client's stream parsing held to the SSE protocol: a stream recorded from
a real server, cut at every possible point; multi-line data, comments, CRLF,
in-band errors and [DONE] on hand-written streams."""

from __future__ import annotations

import httpx
import pytest

from clients.python import StreamError, TextStream
from live_server import run_server, tiny_config


class Chunks(httpx.SyncByteStream):
    """A response body that arrives in the given pieces, as a network may cut it."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces


def stream_of(pieces: list[bytes], chat: bool = True) -> TextStream:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Chunks(pieces))
    return TextStream(response, chat=chat)


def parse(pieces: list[bytes], chat: bool = True) -> tuple[list[str], TextStream]:
    stream = stream_of(pieces, chat)
    return list(stream), stream


@pytest.fixture(scope="module")
def recorded(tiny_llama_path) -> bytes:
    """The raw bytes of a real chat stream (with usage and [DONE])."""
    with run_server(tiny_config(tiny_llama_path)) as live:
        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body) as response:
            return response.read()


def test_every_split_point_of_a_recorded_stream_parses_the_same(recorded):
    whole, reference = parse([recorded])
    assert reference.done and reference.usage.completion_tokens == 12
    assert len(whole) >= 2 and reference.finish_reason == "length"
    for cut in range(1, len(recorded)):
        texts, stream = parse([recorded[:cut], recorded[cut:]])
        assert "".join(texts) == "".join(whole), cut
        assert stream.usage == reference.usage and stream.done, cut


def test_byte_by_byte(recorded):
    texts, stream = parse([bytes([b]) for b in recorded])
    assert "".join(texts) == "".join(parse([recorded])[0]) and stream.done


def chunk(text: str, index: int = 0) -> str:
    return ('{"id": "c", "choices": [{"index": %d, "delta": {"content": "%s"}, '
            '"finish_reason": null}]}' % (index, text))


def test_comments_crlf_and_other_choices():
    raw = (f": ping\r\n\r\ndata: {chunk('Hel')}\r\n\r\n: keep-alive\n\n"
           f"data: {chunk('ignored', 1)}\n\ndata: {chunk('lo')}\r\n\r\ndata: [DONE]\n\n")
    texts, stream = parse([raw.encode()])
    assert texts == ["Hel", "lo"] and stream.done


def test_data_over_several_lines_is_one_event():
    event = ('data: {"id": "c", "choices": [{"index": 0,\n'
             'data: "delta": {"content": "joined"}}]}\n\n')
    texts, _ = parse([event.encode(), b"data: [DONE]\n\n"])
    assert texts == ["joined"]


def test_in_band_error_raises_with_the_servers_message():
    error = ('data: {"error": {"message": "the server is shutting down", '
             '"type": "ServiceUnavailableError", "code": "shutting_down"}}\n\n')
    stream = stream_of([f"data: {chunk('partial')}\n\n".encode(), error.encode(),
                        b"data: [DONE]\n\n"])
    texts = []
    with pytest.raises(StreamError) as caught:
        for text in stream:
            texts.append(text)
    assert texts == ["partial"]
    assert caught.value.code == "shutting_down"
    assert caught.value.message == "the server is shutting down"


def test_done_ends_the_stream_and_a_cut_stream_is_not_done():
    texts, stream = parse([f"data: {chunk('a')}\n\ndata: [DONE]\n\ndata: {chunk('b')}\n\n"
                           .encode()])
    assert texts == ["a"] and stream.done
    texts, stream = parse([f"data: {chunk('a')}\n\n".encode()])  # the connection ended
    assert texts == ["a"] and not stream.done


def test_completion_chunks():
    raw = ('data: {"id": "x", "choices": [{"index": 0, "text": "one ", "finish_reason": null}]}'
           '\n\ndata: {"id": "x", "choices": [{"index": 0, "text": "two", '
           '"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
    texts, stream = parse([raw.encode()], chat=False)
    assert texts == ["one ", "two"] and stream.finish_reason == "stop"


def test_reasoning_deltas_gather_in_thought_and_text_is_the_answer():
    pieces = [b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"Hm",'
              b'"reasoning":"Hm"}}]}\n\n',
              b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning":", two."}}]}\n\n',
              b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Four."}}]}\n\n',
              b"data: [DONE]\n\n"]
    texts, stream = parse(pieces)
    assert texts == ["Four."] and stream.thought == "Hm, two."
