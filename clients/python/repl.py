"""`pagedserve chat`: a terminal chat with a running server, on the Python client.

    pagedserve chat --system "You are terse."
    you> Hello
    Hi. How can I help?
    you> /reset          (a new conversation)
    you> /exit           (or Ctrl-D)

Answers stream as they are generated. Ctrl-C stops the answer being written
(the request is aborted on the server; what arrived stays in the history)
and returns to the prompt; at the prompt it does nothing but a new line.
Each conversation sends one X-Session-ID, so a load balancer keeps it on the
replica that holds its history in the KV cache.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid

from clients.python.client import DEFAULT_URL, Client
from clients.python.errors import APIError

COMMANDS = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve chat",
                                     description="chat with a running pagedserve server")
    parser.add_argument("--base-url", default=DEFAULT_URL)
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="default: $PAGEDSERVE_API_KEY")
    parser.add_argument("--model", default=None, help="default: the server's")
    parser.add_argument("--system", default=None, help="a system prompt for every conversation")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the server's (the model's generation config)")
    return parser


class Conversation:
    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        self.client = client
        self.args = args
        self.reset()

    def reset(self) -> None:
        system = self.args.system
        self.messages = [{"role": "system", "content": system}] if system else []
        self.client.use_session(uuid.uuid4().hex)

    def ask(self, text: str, out) -> None:
        """Stream one answer to `out`; Ctrl-C stops it and keeps what arrived."""
        self.messages.append({"role": "user", "content": text})
        pieces, stream = [], None
        try:
            # Inside the try: a Ctrl-C while the answer's first byte is awaited (a
            # long prompt's prefill) stops the answer too, not the whole chat.
            stream = self.client.chat_stream(self.messages, model=self.args.model,
                                             max_tokens=self.args.max_tokens,
                                             temperature=self.args.temperature)
            for piece in stream:
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            if stream is not None:
                stream.close()  # the server aborts the request
            out.write(" [stopped]")
        finally:
            out.write("\n")
            out.flush()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})


def main(argv: list[str] | None = None, stdin=None, out=None) -> int:
    args = build_parser().parse_args(argv)
    stdin, out = stdin or sys.stdin, out or sys.stdout
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C is how an answer is stopped, so it must raise KeyboardInterrupt
        # here even where the chat was started with SIGINT ignored (a background
        # job of a shell without job control passes that on to its children).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with Client(args.base_url, args.api_key, max_retries=2) as client:
        conversation = Conversation(client, args)
        out.write(f"chatting with {args.base_url}; {COMMANDS}\n")
        while True:
            try:
                out.write("you> ")
                out.flush()
                line = stdin.readline()
            except KeyboardInterrupt:
                out.write("\n")
                continue
            if not line or line.strip() == "/exit":
                return 0
            text = line.strip()
            if text == "/reset":
                conversation.reset()
                out.write("(a new conversation)\n")
            elif text:
                try:
                    conversation.ask(text, out)
                except APIError as exc:
                    out.write(f"error: {exc.message}\n")
                    conversation.messages.pop()  # the question got no answer
