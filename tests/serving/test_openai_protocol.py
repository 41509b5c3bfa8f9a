"""`parse_completion_request` on its own: what a body becomes, and the parameter each bad body is refused for.

The server's tests send these bodies over HTTP; here the parser is called directly, so every edge case costs
nothing and the refusal's ``param`` (what a client reads to find its mistake) is checked for each.
"""

from __future__ import annotations

import math

import pytest

from nanolab.serving.openai_protocol import InvalidRequest, parse_completion_request


def parse(**body):
    return parse_completion_request(body, "tinypy")


def test_a_minimal_body_gets_openai_defaults():
    req = parse(prompt="def f")
    assert req.prompts == ["def f"] and req.model == "tinypy"
    assert (req.params.max_tokens, req.params.temperature, req.params.top_p, req.params.n) == (
        16,
        1.0,
        1.0,
        1,
    )
    assert (req.stream, req.include_usage, req.ignored) == (False, False, ())


def test_null_fields_mean_the_default_and_unknown_fields_are_listed_not_refused():
    req = parse(prompt=[1, 2], temperature=None, top_p=None, max_tokens=None, zzz={"a": [1]}, aaa=1)
    assert req.prompts == [[1, 2]] and req.params.temperature == 1.0 and req.params.max_tokens == 16
    assert req.ignored == ("aaa", "zzz")


def test_prompts_of_every_shape_and_a_stop_string_becomes_a_list():
    assert parse(prompt=["a", "b"]).prompts == ["a", "b"]
    assert parse(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    assert parse(prompt="x", stop="\n").params.stop == ["\n"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt", None),
        ("prompt", ""),
        ("prompt", []),
        ("prompt", [[]]),
        ("prompt", ["a", [1]]),
        ("prompt", [True]),
        ("prompt", {"a": 1}),
        ("prompt", 3),
        ("model", "gpt-4"),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", True),
        ("temperature", "1"),
        ("temperature", 10**400),  # no float holds it: the sampler would fail in the middle of a step
        ("top_p", -(10**400)),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_p", [1]),
        ("n", 0),
        ("n", 1.5),
        ("n", False),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", [1]),
        ("stop", {"a": 1}),
        ("seed", 1.5),
        ("seed", "1"),
        ("seed", 2**64),  # torch seeds with 64 bits
        ("seed", -(2**63) - 1),
        ("stream", 1),
        ("stream", "true"),
        ("stream_options", {"include_usage": True}),  # without stream=true
    ],
)
def test_one_bad_field_is_refused_naming_it(field, value):
    body = {"prompt": "def f", field: value}
    with pytest.raises(InvalidRequest) as e:
        parse_completion_request(body, "tinypy")
    assert e.value.param == field


@pytest.mark.parametrize(
    "options",
    [
        0,
        False,
        "",
        [],
        [1],
        "yes",
        {"include_usage": "yes"},
        {"include_usage": 1},
        {"include_usage": True, "continuous_usage_stats": 1},
    ],
)
def test_stream_options_must_be_an_object_of_flags(options):
    """A falsy value that is not an object (0, false, "", []) is refused as well as a truthy one."""
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="x", stream=True, stream_options=options)
    assert e.value.param == "stream_options"


def test_stream_options_null_or_empty_mean_none_asked():
    assert parse(prompt="x", stream=False, stream_options=None).include_usage is False
    assert parse(prompt="x", stream=False, stream_options={}).include_usage is False
    req = parse(
        prompt="x", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": None}
    )
    assert (req.include_usage, req.continuous_usage) == (True, False)


@pytest.mark.parametrize("body", [None, [], "prompt", 3])
def test_a_body_that_is_not_an_object_is_refused_without_a_param(body):
    with pytest.raises(InvalidRequest) as e:
        parse_completion_request(body, "tinypy")
    assert e.value.param is None


def test_an_int_a_float_cannot_hold_is_refused_as_a_timeout_too():
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="x", timeout=10**400)
    assert e.value.param == "timeout"
    assert parse(prompt="x", timeout=10**30).timeout == 1e30  # large, but a float holds it


def test_the_last_sample_s_seed_must_fit_too():
    """Sample i is seeded seed + i: with n = 2 the largest seed is one less."""
    assert parse(prompt="x", seed=2**64 - 2, n=2).params.seed == 2**64 - 2
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="x", seed=2**64 - 1, n=2)
    assert e.value.param == "seed"
