"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt or a conversation
as the token ids serving would run, and token ids back to text.

    /tokenize    {"prompt": "..."}  or  {"messages": [...], "tools": [...]}
                 -> {"count": n, "max_model_len": m, "tokens": [...]}  (+ "token_strs")
    /detokenize  {"tokens": [...]} -> {"prompt": "..."}

A conversation goes through exactly what chat serving runs (its size checks,
tool plan and chat template: routes/chat.py `render_prompt`), so `count`
equals the `usage.prompt_tokens` the same messages get; a prompt is encoded as
completions encodes it (with the tokenizer's special tokens, unless
`add_special_tokens: false`). Behind the same keys as the other /v1 routes.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from service.errors import bad_request, from_decode_error
from service.guards.limits import check_chat_size
from service.protocol.requests import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from service.serving.chat import render_prompt
from service.serving.state import ServiceState, parse
from service.tool_calls.plan import plan_tools


async def tokenize(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, TokenizeRequest)
    state.check_model(body.model)
    _need_tokenizer(state)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send either prompt or messages", param="prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise bad_request("a chat template writes its own special tokens: "
                              "add_special_tokens must be false with messages",
                              param="add_special_tokens")
        tokens = await _chat_tokens(state, body)
    else:
        state.check_text_size(len(body.prompt), "prompt")
        special = body.add_special_tokens is not False
        tokens = await state.off_loop(lambda: state.tokenizer.encode(
            body.prompt, add_special_tokens=special))
    answer = {"count": len(tokens), "max_model_len": state.engine.config.max_model_len,
              "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
    return _json(answer)


async def _chat_tokens(state: ServiceState, body: TokenizeRequest) -> list[int]:
    """The conversation's token ids, as chat serving renders them."""
    try:
        chat = msgspec.convert({"messages": body.messages, "tools": body.tools,
                                "tool_choice": body.tool_choice,
                                "add_generation_prompt": body.add_generation_prompt,
                                "chat_template_kwargs": body.chat_template_kwargs},
                               ChatCompletionRequest, from_attributes=True)
    except msgspec.ValidationError as exc:  # what chat's own decode would have refused
        raise from_decode_error(exc) from None
    check_chat_size(state, chat)
    plan = plan_tools(chat, state.tool_parser)
    _, _, tokens = await state.off_loop(render_prompt, state, chat, plan)
    return tokens


async def detokenize(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, DetokenizeRequest)
    state.check_model(body.model)
    _need_tokenizer(state)
    vocab = len(state.tokenizer)
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the tokenizer's vocabulary "
                          f"(0..{vocab - 1})", param="tokens")
    text = await state.off_loop(lambda: state.tokenizer.decode(body.tokens))
    return _json({"prompt": text})


def _need_tokenizer(state: ServiceState) -> None:
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="model")


def _json(value) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")
