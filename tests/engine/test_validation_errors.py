"""What the engine refuses carries the request field at fault (engine/errors.py).

The HTTP service fills OpenAI's error `param` from `ValidationError.param`, so
every check below must name the field as the API spells it, whatever its
message says; and the error must stay a ValueError whose text is the message.
"""

from __future__ import annotations

import jinja2
import pytest

from bench.common.null_engine import NULL_MODEL, NullRunner
from engine.config import EngineConfig
from engine.errors import ValidationError
from engine.frontend.chat_template import ChatTemplateError, render_chat_text
from engine.frontend.llm_engine import LLMEngine
from engine.sampling.structured_outputs import (
    ConstraintError, StructuredOutputs, StructuredOutputsParams,
)
from engine.sampling_params import SamplingParams


def refused(call, *args, **kwargs) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert isinstance(error, ValueError)  # old `except ValueError` still catches it
    assert str(error) == error.message and error.message
    return error


def test_the_message_is_the_text_and_the_field_is_data():
    error = ValidationError("top_p must be in (0, 1]", "temperature")
    assert str(error) == "top_p must be in (0, 1]"
    assert error.param == "temperature"
    assert ValidationError("no one field").param is None


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": 1e-300}, "top_p"),  # rounds to 0 in float32
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),  # its message names max_tokens too
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**64}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
])
def test_sampling_params_name_the_field(fields, param):
    assert refused(SamplingParams, **fields).param == param


@pytest.mark.parametrize("fields", [
    {}, {"choice": []}, {"json": "{not json"}, {"json": 3}, {"regex": ""},
    {"json_object": "yes"},
])
def test_structured_outputs_params_name_the_field(fields):
    assert refused(StructuredOutputsParams, **fields).param == "structured_outputs"


@pytest.fixture(scope="module")
def compiler(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    return StructuredOutputs(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


@pytest.mark.parametrize("fields", [
    {"regex": "(unclosed"}, {"grammar": "root ::= missing_rule"},
    {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
])
def test_a_constraint_that_does_not_compile_names_the_field(compiler, fields):
    error = refused(compiler.compile, StructuredOutputsParams(**fields))
    assert isinstance(error, ConstraintError) and error.param == "structured_outputs"


def test_no_tokenizer_to_compile_against_names_the_field():
    no_tokenizer = StructuredOutputs(None, 100, {2})
    error = refused(no_tokenizer.compile, StructuredOutputsParams(regex="a"))
    assert error.param == "structured_outputs"


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, num_gpu_blocks_override=32, device="cpu")
    return LLMEngine(config, runner=NullRunner(32), model_info=NULL_MODEL)


@pytest.mark.parametrize("token_ids", [[], [7] * 64, [1, NULL_MODEL.vocab_size], [5, -1]])
def test_check_prompt_names_the_prompt(engine, token_ids):
    assert refused(engine.check_prompt, token_ids).param == "prompt"


def test_a_prompt_the_engine_cannot_read_names_the_prompt(engine):
    assert refused(engine.add_request, "a", "text, and no tokenizer", SamplingParams()).param \
        == "prompt"
    assert refused(engine.add_request, "b", [1, 2.5], SamplingParams()).param == "prompt"
    assert not engine.has_unfinished_requests()


def test_check_params_names_the_field(engine):
    outside = SamplingParams(logit_bias={NULL_MODEL.vocab_size: 1.0})
    assert refused(engine.check_params, outside).param == "logit_bias"
    constrained = SamplingParams(structured_outputs={"regex": "a+"})  # no tokenizer here
    assert refused(engine.check_params, constrained).param == "structured_outputs"


class Tokenizer:
    """Just enough of a Hugging Face tokenizer to render, or to refuse to."""

    chat_template = "{{ raise_exception('roles must alternate') }}"

    def apply_chat_template(self, messages, **kwargs):
        raise jinja2.TemplateError("roles must alternate user/assistant")


@pytest.mark.parametrize("tokenizer", [None, Tokenizer()])
def test_a_conversation_that_cannot_render_names_the_messages(tokenizer):
    error = refused(render_chat_text, tokenizer, [{"role": "user", "content": "hi"}])
    assert isinstance(error, ChatTemplateError) and error.param == "messages"
