import dataclasses
import math

import pytest

from engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert params.n == 1
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.repetition_penalty == 1.0
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.logprobs is None
    assert params.skip_special_tokens is True
    assert params.include_stop_str_in_output is False
    assert params.greedy is False


def test_is_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


def test_stop_string_is_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_stop_list_is_copied_not_aliased():
    stops = ["a"]
    params = SamplingParams(stop=stops)
    stops.append("b")
    assert params.stop == ["a"]


def test_stop_token_ids_normalised_to_list():
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)]
)
def test_greedy_below_threshold(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, ">= 1"),
        ("n", 1.5, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", "hot", ">= 0"),
        ("top_p", 0.0, "[1.18e-38, 1]"),
        ("top_p", 1.01, "[1.18e-38, 1]"),
        ("top_k", -2, "from 0 to"),
        ("top_k", 2.5, "from 0 to"),
        ("top_k", 2**31, "from 0 to"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -2.01, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("frequency_penalty", 2.01, "[-2, 2]"),
        ("repetition_penalty", 0.0, ">= 1.18e-38"),
        ("repetition_penalty", -1.0, ">= 1.18e-38"),
        ("max_tokens", -1, ">= 0"),
        ("max_tokens", None, ">= 0"),
        ("max_tokens", True, ">= 0"),
        ("min_tokens", -1, "[0, max_tokens=16]"),
        ("min_tokens", 17, "[0, max_tokens=16]"),
        ("logprobs", -1, "[0, 20]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "whole vocabulary"),
        ("prompt_logprobs", 21, "[0, 20]"),
        ("seed", 1.0, "integer"),
        ("seed", "42", "integer"),
        ("seed", 2**64, "integer"),
        ("ignore_eos", 1, "bool"),
        ("skip_special_tokens", None, "bool"),
        ("include_stop_str_in_output", "yes", "bool"),
    ],
)
def test_invalid_values_raise_naming_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(field + " must be")
    assert allowed in message
    assert repr(value) in message


@pytest.mark.parametrize(
    "stop", ["", [""], ["ok", ""], [1], 5]
)
def test_invalid_stop_strings(stop):
    with pytest.raises(ValueError, match=r"^stop must"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("ids", [[-1], [1.0], "12", 3])
def test_invalid_stop_token_ids(ids):
    with pytest.raises(ValueError, match=r"^stop_token_ids must"):
        SamplingParams(stop_token_ids=ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"n": 4},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_min_tokens_checked_against_given_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be .*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_replace_revalidates_and_keeps_normalised_fields():
    # The LLM layer fills max_tokens per prompt with dataclasses.replace.
    params = SamplingParams(stop="###", top_k=-1, min_tokens=4)
    filled = dataclasses.replace(params, max_tokens=100)
    assert (filled.max_tokens, filled.stop, filled.top_k) == (100, ["###"], 0)
    with pytest.raises(ValueError, match="^min_tokens"):
        dataclasses.replace(params, max_tokens=3)


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_positive_settings_below_float32s_smallest_normal_are_refused(field):
    # 1e-300 passes "> 0" but is 0 in the sampler's float32: top_p would mask
    # every token, a repetition penalty would divide by zero.
    from engine.sampling_params import FLOAT32_TINY

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: 1e-300})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: FLOAT32_TINY / 2})
    assert getattr(SamplingParams(**{field: FLOAT32_TINY}), field) == FLOAT32_TINY


def test_logit_bias_is_validated_and_normalised():
    assert SamplingParams().logit_bias == {}
    assert SamplingParams(logit_bias={5: 1, 7: -100}).logit_bias == {5: 1.0, 7: -100.0}
    for bad in ({-1: 1.0}, {"5": 1.0}, {True: 1.0}, {5: 100.5}, {5: float("nan")}, [5]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
