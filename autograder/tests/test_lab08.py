"""Hidden tests for Lab 8 (serving): `parse_completion_request` against nanolab's on random good bodies and on
bodies with one bad field, `completion_events` against nanolab's `stream_completion` on random streams, the
learner's `EngineLoop` against nanolab's round by round on the toy engine, and `histogram_quantile` against
nanolab's on random histograms.

Everything of the learner's is driven from here through the `lab` fixture: the requests, outputs, commands,
parameters and toy engines are built through `lab` (the setup's own classes), every call and every read-back
goes through a handle, and no code of the notebook drives anything. nanolab's references run here on the same
inputs (`labkit.lab08.ToyEngine` beside nanolab's `EngineLoop`, its failed steps raised as nanolab's
`EngineStepError`), and the two are compared as plain data.

A refusal of `parse_completion_request` arrives here as a `RemoteError`, which carries the exception's type
and message only, not its ``param``. To read the ``param`` without any code of the notebook in between, the
call is made through the standard library's `unittest.TestCase.assertRaises` context, built in the sandbox
through handles (`ExceptionCatcher`): it keeps the exception the learner's function raised, whose ``param`` is then
read through its handle. Feedback says what is wrong and on which input, never the expected answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re

import pytest

from autograder.testing import ExceptionCatcher, Remote, RemoteError, expect, expect_value_error
from labkit.lab08 import EngineStepError as ToyStepError
from labkit.lab08 import SamplingParams as ToyParams
from labkit.lab08 import ToyEngine
from nanolab.engine.core import EngineStepError as NanolabStepError
from nanolab.engine.outputs import CompletionOutput as NanolabCompletion
from nanolab.engine.outputs import RequestOutput as NanolabOutput
from nanolab.model.sampling import SamplingParams as NanolabParams
from nanolab.serving import openai_protocol, responses
from nanolab.serving.async_engine import AbortCommand, AddCommand, EngineLoop, RequestGroup
from nanolab.serving.metrics import histogram_quantile

MODEL = "tinypy"
INF, NAN = math.inf, math.nan


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


# ---------------------------------------------------------------------------------------------- validation

# Values each field may take in a valid body (absent is also drawn), and values that make it bad on their own.
GOOD = {
    "model": [None, MODEL],
    "max_tokens": [None, 1, 2, 16, 200, 10**30],
    "temperature": [None, 0, 0.0, 0.7, 1, 2.5, 1e300, 10**30],
    "top_p": [None, 1, 1.0, 0.5, 1e-9, 5e-324],
    "n": [None, 1, 2, 3, 5],
    "seed": [None, 0, -7, 42, -(2**63), 2**63, 2**64 - 8],  # seed + n - 1 fits 64 bits
    "stop": [None, "\n", "ab", "é", [], ["#"], ["a", "\n\n"], ["x", "y", "z"]],
    "stream": [None, True, False],
}
BAD = {
    "model": ["gpt-4", "", "TINYPY", 3, [], {}, False, [MODEL]],
    "prompt": [
        None,
        "",
        [],
        [[]],
        ["a", [1]],
        [True],
        [1, True],
        3,
        1.5,
        {"a": 1},
        [1.5],
        [["a"]],
        ["a", ""],
        [[1], []],
        [None],
        False,
        [[1], "a"],
        [[1, 2.0]],
        [[[1]]],
    ],  # fmt: skip
    "max_tokens": [0, -1, -(10**30), 2.0, 1.5, True, False, "16", INF, -INF, NAN, [16], {}, ""],
    "temperature": [-0.5, -1, -1e-300, INF, -INF, NAN, 10**400, True, False, "1", [0], {}, ""],
    "top_p": [0, 0.0, -0.0, 1.01, 1 + 1e-15, 2, -1, NAN, INF, -INF, True, False, {}, "0.5", []],
    "n": [0, -1, 1.5, 2.0, True, False, "2", INF, NAN, [1]],
    "seed": [1.5, 0.0, "1", True, False, [1], {}, NAN, INF, 10**30, 2**64, -(2**63) - 1],
    "stop": ["", ["a", ""], [1], {"a": 1}, 3, [["a"]], True, [None], 0.0, ["a", 2]],
    "stream": [1, 0, "true", [True], "", {}, 0.0],
}
# stream_options: bad whatever the stream (not an object, or include_usage not true/false/null), and bad only
# without stream true (a non-empty object).
BAD_OPTIONS = [0, [], "", False, True, "x", 1.5, [{"include_usage": True}], {"include_usage": "yes"},
               {"include_usage": 1}, {"include_usage": 0}, {"include_usage": []}, {"include_usage": {}}]  # fmt: skip
OPTIONS_NEED_STREAM = [
    {"include_usage": True},
    {"include_usage": False},
    {"include_usage": None},
    {"x_extra": 1},
]
GOOD_OPTIONS = [{}, {"include_usage": True}, {"include_usage": False}, {"include_usage": None}, {"x_extra": 1},
                {"include_usage": True, "x_extra": [1, {"a": None}]}]  # fmt: skip
# Field names nanolab's server does not know either (it knows more fields than the lab's parser).
UNKNOWN = [
    "x_foo",
    "zz_tag",
    "a_custom",
    "vendor_opt",
    "Prompt",
    "MAX_TOKENS",
    "extra_body",
    "metadata_x",
    "_",
]
JUNK = [None, 1, "x", NAN, [1, [2]], {"k": {"l": []}}, True, -INF]
NOT_OBJECTS = [None, [], "prompt", 3, 1.5, True, [{"prompt": "x"}], ["prompt", "x"]]


def random_prompt(rng):
    kind = rng.randrange(4)
    if kind == 0:
        return "".join(rng.choice("def f(x):\n é😀") for _ in range(rng.randint(1, 12)))
    if kind == 1:
        return [rng.randint(-3, 50_000) for _ in range(rng.randint(1, 8))]
    if kind == 2:
        return [
            "".join(rng.choice("ab #\n") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))
        ]
    return [[rng.randint(0, 999) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]


def good_body(rng) -> dict:
    """A valid body: a prompt, a random subset of the other fields with good values, unknown fields."""
    fields = {"prompt": random_prompt(rng)}
    for name, values in GOOD.items():
        if rng.random() < 0.6:
            fields[name] = rng.choice(values)
    if rng.random() < 0.4:
        fields["stream_options"] = rng.choice(GOOD_OPTIONS if fields.get("stream") is True else [None, {}])
    for name in rng.sample(UNKNOWN, rng.choice([0, 0, 1, 2, 3])):
        fields[name] = rng.choice(JUNK)
    names = list(fields)
    rng.shuffle(names)  # the order of a body's fields says nothing
    return {name: fields[name] for name in names}


def bad_bodies(rng) -> list[tuple[dict, str]]:
    """Every bad value of every field, once, in an otherwise valid random body: (body, the field at fault)."""
    cases = []
    for name, values in BAD.items():
        for value in values:
            body = good_body(rng)
            if value is None:  # the prompt missing, or null
                body.pop(name, None) if rng.random() < 0.5 else body.update({name: None})
            else:
                body[name] = value
            cases.append((body, name))
    for _ in range(3):  # a seed whose last sample's seed (seed + n - 1) does not fit 64 bits
        body = good_body(rng)
        n = rng.randint(2, 5)
        body.update(n=n, seed=2**64 - 1 - rng.randint(0, n - 2))
        cases.append((body, "seed"))
    for value in BAD_OPTIONS:
        body = good_body(rng)
        # an object is refused for its include_usage only with stream true (without, it is refused anyway)
        body["stream"] = True if isinstance(value, dict) else rng.choice([True, False, None])
        body["stream_options"] = value
        cases.append((body, "stream_options"))
    for value in OPTIONS_NEED_STREAM:
        body = good_body(rng)
        body.pop("stream", None) if rng.random() < 0.5 else body.update({"stream": rng.choice([False, None])})
        body["stream_options"] = value
        cases.append((body, "stream_options"))
    rng.shuffle(cases)
    return cases


def reference_parse(body) -> tuple:
    """nanolab's verdict on a body: ("ok", fields) or ("refused", param)."""
    try:
        r = openai_protocol.parse_completion_request(body, MODEL)
    except openai_protocol.InvalidRequest as e:
        return ("refused", e.param)
    p = r.params
    return ("ok", dict(prompts=r.prompts, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                       n=p.n, stop=p.stop, seed=p.seed, stream=r.stream, include_usage=r.include_usage,
                       ignored=list(r.ignored), model=r.model))  # fmt: skip


def learner_request(lab, body, request) -> dict:
    """The learner's CompletionRequest for ``body``, read back field by field through its handles."""
    where = f"parse_completion_request({_short(body)}, {MODEL!r})"
    if not isinstance(request, Remote) or request.type_name != "CompletionRequest":
        raise AssertionError(f"{where} should return a CompletionRequest, not {type(request).__name__}")
    try:
        p = request.params
        return dict(prompts=request.prompts, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                    n=p.n, stop=p.stop, seed=p.seed, stream=request.stream, include_usage=request.include_usage,
                    ignored=request.ignored, model=request.model)  # fmt: skip
    except RemoteError as e:
        raise AssertionError(f"{where}: reading the request's fields back raised {e.type_name}") from None


FIELD_HINTS = {
    "prompts": "prompts is always a list of prompts (one string or one list of token ids becomes a list of one)",
    "max_tokens": "max_tokens: the body's value, or 16 when it is absent or null",
    "temperature": "temperature: the body's value, or 1.0 when it is absent or null",
    "top_p": "top_p: the body's value, or 1.0 when it is absent or null",
    "n": "n: the body's value, or 1 when it is absent or null",
    "stop": "stop: None when absent or null, otherwise always a list (one string becomes a list of one)",
    "seed": "seed: the body's value, or None",
    "stream": "stream: the body's true or false, false when absent or null",
    "include_usage": "include_usage: stream_options.include_usage as true or false (absent or null: false)",
    "ignored": "ignored: the names of the body's fields outside KNOWN_FIELDS, sorted",
    "model": "model: the name of the model served",
}


def check_accepted(lab, body: dict, want: dict) -> None:
    where = f"the valid body {_short(body)}"
    try:
        request = lab.parse_completion_request(body, MODEL)
    except RemoteError as e:
        raise AssertionError(f"{where} was refused ({e.type_name}): it is a valid request") from None
    got = learner_request(lab, body, request)
    for key, hint in FIELD_HINTS.items():
        a, b = got[key], want[key]
        if key in ("prompts", "ignored", "stop") and isinstance(a, (list, tuple)):
            a = list(a)
        same = a == b and type(a) is type(b) if key in ("stream", "include_usage") else a == b
        assert same and not (isinstance(a, bool) and not isinstance(b, bool)), (
            f"{where}: its {key} is {_short(got[key], 120)}: {hint}"
        )


def check_refused(lab, catcher: ExceptionCatcher, body, param, what: str) -> None:
    exc = catcher.raised(lab.parse_completion_request, body, MODEL)
    assert exc is not None, (
        f"{what} {_short(body)} should be refused with InvalidRequest, but yours accepted it"
    )
    assert exc.type_name == "InvalidRequest", (
        f"{what} {_short(body)}: yours raised {exc.type_name}: refuse bad input with InvalidRequest(message, param)"
    )
    try:
        got = exc.param
    except RemoteError:
        raise AssertionError(f"{what} {_short(body)}: your InvalidRequest has no param") from None
    assert got == param, f"{what} {_short(body)}: yours refused it naming param {got!r}: " + (
        "param names the field at fault"
        if param is not None
        else "a body that is not an object has param None"
    )


@pytest.mark.points(1)
def test_parse_builds_the_same_request_as_nanolab(lab, rng):
    """parse_completion_request turns random valid bodies (every field absent, null or good, unknown fields, any order) into nanolab's request, field by field"""
    for _ in range(120):
        body = good_body(rng)
        verdict = reference_parse(body)
        assert verdict[0] == "ok", f"the test made a body nanolab refuses: {body}"  # a bug of the test itself
        check_accepted(lab, body, verdict[1])


@pytest.mark.points(1)
def test_parse_refuses_a_bad_field_naming_it(lab, rng):
    """parse_completion_request refuses each bad value of each field (wrong types, NaN and infinities, bools for numbers, strings for numbers, nested lists and objects, empty strings and lists, stream_options without stream) with InvalidRequest naming the field, and a body that is not an object with param None"""
    catcher = ExceptionCatcher(lab)
    for body, field in bad_bodies(rng):
        verdict = reference_parse(body)
        assert verdict == ("refused", field), (
            f"the test made a body nanolab does not refuse as planned: {body}"
        )
        check_refused(lab, catcher, body, field, "the body")
    for body in NOT_OBJECTS:
        assert reference_parse(body) == ("refused", None)
        check_refused(lab, catcher, body, None, "the body that is not a JSON object,")


# ---------------------------------------------------------------------------------------------- the stream

REASONS = ["stop", "length", "abort", "timeout"]


def random_stream(rng) -> tuple[list, int, int]:
    """A stream's items as plain data, in the order steps would make them: ("out", prompt index, request id,
    prompt token ids, samples, finished) with samples (index, text, token ids, finish reason, delta text, delta
    token ids), or ("error", message). Finish reasons arrive at different steps and are repeated afterwards;
    some outputs have new tokens but no new text (held back), some none at all; some streams fail, and some
    have items after their end."""
    num_prompts, n = rng.randint(1, 3), rng.randint(1, 3)
    prompts = [[rng.randint(1, 99) for _ in range(rng.randint(1, 7))] for _ in range(num_prompts)]
    text = {(p, s): "" for p in range(num_prompts) for s in range(n)}
    ids: dict = {(p, s): [] for p in range(num_prompts) for s in range(n)}
    reason: dict = {}
    items, live = [], list(range(num_prompts))
    fails = rng.random() < 0.25
    while live:
        p = rng.choice(live)
        samples = []
        for s in range(n):
            new_ids, new_text = [], ""
            if (p, s) not in reason:
                new_ids = [rng.randint(0, 999) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
                if new_ids and rng.random() < 0.8:
                    new_text = "".join(rng.choice('xyz é😀\n"\\') for _ in range(rng.randint(1, 3)))
                if rng.random() < 0.3:
                    reason[(p, s)] = rng.choice(REASONS)
            text[(p, s)] += new_text
            ids[(p, s)] += new_ids
            samples.append((s, text[(p, s)], list(ids[(p, s)]), reason.get((p, s)), new_text, new_ids))
        finished = all((p, s) in reason for s in range(n))
        if finished:
            live.remove(p)
        items.append(("out", p, f"cmpl-x-{p}", prompts[p], samples, finished))
        if fails and rng.random() < 0.25:
            items.insert(len(items) - rng.randint(0, 1), ("error", "the model runner failed"))
            break
    if rng.random() < 0.3:  # items after the end are never read
        p = rng.randrange(num_prompts)
        after = [(s, "late", [1], "stop", "late", [1]) for s in range(n)]
        items.append(rng.choice([("error", "too late"), ("out", p, f"cmpl-x-{p}", prompts[p], after, True)]))
    return items, num_prompts, n


def reference_events(items, cid, model, created, num_prompts, n, include_usage) -> list[str]:
    """The events nanolab's server streams for these items, one queued item read at a time."""

    def convert(item):
        if item[0] == "error":
            return NanolabStepError(item[1], [])
        _, _, rid, prompt, samples, finished = item
        outputs = [NanolabCompletion(i, t, list(x), r, d, list(dx)) for i, t, x, r, d, dx in samples]
        return NanolabOutput(rid, None, list(prompt), outputs, finished, None)

    class Client:  # what stream_completion asks of the engine client
        tokenizer = None

        def abort(self, request_ids):
            pass

    request = openai_protocol.CompletionRequest(
        ["-"] * num_prompts, NanolabParams(n=n), model, True, include_usage
    )

    async def collect():
        group = RequestGroup(cid, num_prompts, asyncio.get_running_loop())
        for item in items:
            group.queue.put_nowait((item[1] if item[0] == "out" else 0, convert(item)))
        return [event async for event in responses.stream_completion(Client(), group, request)]

    async def one_at_a_time(group):
        return [await group.queue.get()]

    saved = responses._ready_items, openai_protocol.now
    responses._ready_items, openai_protocol.now = one_at_a_time, lambda: created
    try:
        chunks = asyncio.run(collect())
    finally:
        responses._ready_items, openai_protocol.now = saved
    return [e for chunk in chunks for e in re.findall(r"data: .*?\n\n", chunk, re.S)]


def learner_items(lab, items) -> list:
    """The items built in the sandbox with the setup's classes: (prompt index, RequestOutput or EngineStepError)."""
    built = []
    for item in items:
        if item[0] == "error":
            built.append((0, lab.EngineStepError(item[1])))
            continue
        _, p, rid, prompt, samples, finished = item
        outputs = [lab.CompletionOutput(i, t, x, r, d, dx) for i, t, x, r, d, dx in samples]
        built.append((p, lab.RequestOutput(rid, prompt, outputs, finished)))
    return built


def parse_events(events: list[str], where: str) -> list:
    parsed = []
    for e in events:
        assert isinstance(e, str) and e.startswith("data: ") and e.endswith("\n\n"), (
            f"{where}: the event {_short(e, 120)} is not 'data: <json>' and a blank line (make each with sse)"
        )
        body = e[len("data: ") : -2]
        if body == "[DONE]":
            parsed.append("[DONE]")
            continue
        try:
            parsed.append(json.loads(body))
        except ValueError:
            raise AssertionError(f"{where}: the event {_short(e, 120)} is not JSON") from None
    return parsed


def describe_stream(items, num_prompts, n, usage) -> str:
    failed = any(item[0] == "error" for item in items)
    return f"{num_prompts} prompt(s), n={n}, include_usage {usage}, {len(items)} items" + (
        ", one of them a failed step" if failed else ""
    )


def compare_events(got: list, want: list, where: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        chunk = isinstance(a, dict) and bool(a.get("choices"))
        if chunk and not (isinstance(b, dict) and b.get("choices")):  # a chunk where the stream has none
            hint = (
                "a chunk more than the stream has here: one per sample that has new text or finishes now, "
                "the finish reason sent once, nothing after the stream is over"
            )
        elif isinstance(b, dict) and "error" in b:
            hint = "a failed step ends the stream with the error event (type server_error), then [DONE]"
        elif b == "[DONE]":
            hint = "the stream is over once every prompt's request finished (or an error came): then [DONE]"
        elif isinstance(b, dict) and b.get("choices") == []:
            hint = "the usage chunk: each prompt's tokens once, every sample's output tokens"
        elif isinstance(a, dict) and isinstance(b, dict) and set(a) != set(b):
            hint = "a chunk has id, object, created, model, choices (and usage: null with include_usage)"
        else:
            hint = "check the choice index (prompt * n + sample), the text delta, and the finish reason (sent once)"
        raise AssertionError(f"{where}, event {i}: yours is {_short(a, 200)}: {hint}")
    assert len(got) == len(want), (
        f"{where}: yours sent {len(got)} events: one chunk per sample that has new text or finishes now, "
        "the usage chunk when asked, the error event on a failed step, and [DONE] last"
    )


@pytest.mark.points(2)
def test_events_match_nanolab_stream(lab, rng):
    """completion_events sends nanolab's events on random streams (several prompts, n up to 3, finish reasons at different steps and repeated after, text held back, usage on and off, a failed step, items after the end), compared event by event as JSON"""
    for trial in range(100):
        items, num_prompts, n = random_stream(rng)
        usage = rng.random() < 0.5
        cid, created = f"cmpl-{rng.randrange(10**6)}", rng.randint(1_600_000_000, 1_800_000_000)
        want = parse_events(reference_events(items, cid, MODEL, created, num_prompts, n, usage), "nanolab")
        where = f"stream {trial} ({describe_stream(items, num_prompts, n, usage)})"
        try:
            events = lab.completion_events(
                learner_items(lab, items), cid, MODEL, created, num_prompts, n, usage
            )
        except RemoteError as e:
            raise AssertionError(
                f"{where}: your completion_events raised {e.type_name}: {e.message[:200]}"
            ) from None
        got = parse_events(expect(events, list, f"completion_events(...) on {where}"), where)
        compare_events(got, want, where)


# ---------------------------------------------------------------------------------------------- the engine loop


class OracleToy(ToyEngine):
    """The setup's toy engine for nanolab's EngineLoop, whose failed steps raise nanolab's EngineStepError."""

    def step(self):
        try:
            return super().step()
        except ToyStepError as e:
            raise NanolabStepError(str(e), e.outputs) from e


def random_ops(rng, n_ops: int = 40) -> list:
    """A random session of the HTTP side with one engine: adds (some bad: an empty prompt, a token outside the
    vocabulary, too long, an id in use), requests put in the engine behind the loop's back, aborts (of live,
    finished and unknown requests), time passing (to deadlines exactly, and past them), steps (some of which
    fail) and rounds taken."""
    settings = dict(
        max_num_seqs=rng.randint(1, 4), max_model_len=24, fail_at=rng.sample(range(1, 30), rng.randint(0, 3))
    )
    ops: list = [("engine", settings)]
    ids, side, now = [], [], 0.0
    for k in range(n_ops):
        x = rng.random()
        if x < 0.25:
            size = rng.randint(1, 3)
            new = [f"q{k}-{i}" for i in range(size)]
            if ids and rng.random() < 0.1:
                new[rng.randrange(size)] = rng.choice(ids)
            prompts = [
                [rng.randint(0, 26 if rng.random() < 0.05 else 25) for _ in range(rng.randint(0 if rng.random() < 0.05 else 1, 8))]
                for _ in new
            ]  # fmt: skip
            deadline = now + rng.randint(0, 8) if rng.random() < 0.4 else None
            ops.append(("add", k, new, prompts, [rng.randint(1, 16) for _ in new], deadline))
            ids += new
        elif x < 0.28:
            rid = f"side{k}"
            ops.append(
                ("direct", rid, [rng.randint(1, 25) for _ in range(rng.randint(1, 4))], rng.randint(1, 8))
            )
            side.append(rid)
        elif x < 0.38 and ids:
            extra = rng.choice([[], [], [], ["nobody"], side[-1:]])  # unknown, or behind the loop's back
            ops.append(("abort", rng.sample(ids, min(len(ids), rng.randint(1, 2))) + extra))
        elif x < 0.48:
            now += rng.randint(0, 3)
            ops.append(("expire", now))
        else:
            ops.append(("step",))
        if rng.random() < 0.4:
            ops.append(("round",))
    ops.append(("round",))
    return ops


def op_text(op) -> str:
    kind = op[0]
    if kind == "add":
        _, add_id, ids, prompts, max_tokens, deadline = op
        reqs = ", ".join(f"{r}: {p} max_tokens {m}" for r, p, m in zip(ids, prompts, max_tokens))
        return f"add {add_id} [{reqs}]" + (f" deadline {deadline:g}" if deadline is not None else "")
    if kind == "direct":
        return f"engine.add_requests({op[1]!r}: {op[2]} max_tokens {op[3]}) behind the loop"
    if kind == "abort":
        return f"abort {op[1]}"
    if kind == "expire":
        return f"expire({op[1]:g})"
    if kind == "engine":
        return f"ToyEngine({', '.join(f'{k}={v}' for k, v in op[1].items())})"
    return kind


def ops_text(ops: list) -> str:
    text = "; ".join(op_text(op) for op in ops)
    return text if len(text) < 900 else "...; " + text[-860:]


def reference_session(ops: list) -> list[dict]:
    """nanolab's EngineLoop over the toy engine, driven with ``ops``: every round as plain data."""
    engine = OracleToy(**ops[0][1])
    loop = EngineLoop(engine)
    rounds = []
    level = logging.getLogger("nanolab.server").level
    logging.getLogger("nanolab.server").setLevel(logging.CRITICAL)  # it logs each failed step
    try:
        for op in ops[1:]:
            kind = op[0]
            if kind == "add":
                _, add_id, ids, prompts, max_tokens, deadline = op
                params = [ToyParams(max_tokens=m) for m in max_tokens]
                loop.handle(AddCommand(add_id, list(ids), [list(p) for p in prompts], params, 0, deadline))
            elif kind == "direct":
                engine.add_requests([op[2]], [ToyParams(max_tokens=op[3])], 0, [op[1]])
            elif kind == "abort":
                loop.handle(AbortCommand(list(op[1])))
            elif kind == "expire":
                loop.expire(op[1])
            elif kind == "step":
                if engine.has_unfinished():
                    loop.step()
            else:
                r = loop.take_round()
                rounds.append(
                    dict(
                        accepted=[tuple(a) for a in r.accepted],
                        refused=[tuple(x) for x in r.refused],
                        outputs=[
                            (
                                o.request_id,
                                o.outputs[0].delta_token_ids,
                                o.outputs[0].finish_reason,
                                o.finished,
                            )
                            for o in r.outputs
                        ],
                        failed=[tuple(f) for f in r.failed],
                        step_errors=r.step_errors,
                        handled=r.handled,
                        waiting=r.stats.num_waiting,
                        live=sorted(loop.live),
                        deadlines=sorted(loop.deadlines.items()),
                        unfinished=engine.has_unfinished(),
                    )
                )
    finally:
        logging.getLogger("nanolab.server").setLevel(level)
    return rounds


def read_round(loop, where: str) -> dict:
    """The learner's round, taken and read back through its handles."""
    r = loop.take_round()
    assert isinstance(r, Remote) and r.type_name == "Round", (
        f"{where}: take_round should return a Round, not {r.type_name if isinstance(r, Remote) else type(r).__name__}"
    )
    outputs = []
    for o in expect(r.outputs, list, f"{where}: round.outputs"):
        sample = expect(o.outputs, list, f"{where}: an output's outputs")[0]
        outputs.append((o.request_id, sample.delta_token_ids, sample.finish_reason, o.finished))
    stats = r.stats
    live, deadlines = loop.live, loop.deadlines
    return dict(
        accepted=[tuple(a) for a in expect(r.accepted, list, f"{where}: round.accepted")],
        refused=[tuple(x) for x in expect(r.refused, list, f"{where}: round.refused")],
        outputs=outputs,
        failed=[tuple(f) for f in expect(r.failed, list, f"{where}: round.failed")],
        step_errors=r.step_errors,
        handled=r.handled,
        waiting=stats.num_waiting if isinstance(stats, Remote) else stats,
        live=sorted(expect(live, (set, frozenset, list), f"{where}: live")),
        deadlines=sorted(expect(deadlines, dict, f"{where}: deadlines").items()),
    )


def learner_session(lab, ops: list, where: str) -> list[dict]:
    """The learner's EngineLoop over the setup's toy engine in the sandbox, driven here op by op through its
    handles (the commands and parameters built with the setup's classes), every round read back."""
    toy = lab.ToyEngine(**ops[0][1])
    loop = lab.EngineLoop(toy)
    rounds = []
    for i, op in enumerate(ops[1:], 1):
        kind = op[0]
        try:
            if kind == "add":
                _, add_id, ids, prompts, max_tokens, deadline = op
                params = [lab.SamplingParams(max_tokens=m) for m in max_tokens]
                loop.handle(
                    lab.AddCommand(add_id, list(ids), [list(p) for p in prompts], params, 0, deadline)
                )
            elif kind == "direct":
                toy.add_requests([op[2]], [lab.SamplingParams(max_tokens=op[3])], 0, [op[1]])
            elif kind == "abort":
                loop.handle(lab.AbortCommand(list(op[1])))
            elif kind == "expire":
                loop.expire(op[1])
            elif kind == "step":
                if toy.has_unfinished():
                    loop.step()
            else:
                rounds.append(read_round(loop, f"{where}, round {len(rounds)}"))
        except RemoteError as e:
            raise AssertionError(
                f"{where}: your loop raised {e.type_name}: {e.message[:200]} at op {i} of [{ops_text(ops[: i + 1])}]"
            ) from None
    return rounds


ROUND_KEYS = [
    ("accepted", "round.accepted: (add id, prompt tokens of all its requests) for an add the engine took"),
    ("refused", "a bad add is refused whole: (add id, 'invalid', the engine's message, its param or None)"),
    ("outputs", "pass on the outputs of live requests only, in the order they came, each once"),
    ("failed", "a failed step: each of its requests that is live fails once, (request id, str(error))"),
    ("step_errors", "count each step that raised EngineStepError"),
    ("handled", "handled is LoopBase.handle's count of prompts taken off the queue"),
    ("waiting", "stats: engine.stats() when the round is taken"),
    ("live", "a request is live from its accepted add until its last output (finished, aborted, timed out, failed)"),
    ("deadlines", "a deadline is kept while its request is live, and dropped when it ends"),
]  # fmt: skip


OP_HINTS = {
    "add": "an add is all or none",
    "abort": "an abort passes on one final output of each live request it names, and nothing for the others",
    "expire": "expire(now) ends every live request whose deadline is now or earlier, with finish reason 'timeout'",
    "step": "a step passes on the outputs of live requests; a failed one fails its live requests",
}


def compare_sessions(got: list[dict], want: list[dict], ops: list, where: str) -> None:
    round_ends = [i for i, op in enumerate(ops) if op[0] == "round"]
    for i, (a, b) in enumerate(zip(got, want)):
        since = ops[(round_ends[i - 1] if i else 0) + 1 : round_ends[i]]
        hints = [OP_HINTS[kind] for kind in OP_HINTS if any(op[0] == kind for op in since)]
        for key, why in ROUND_KEYS:
            if a[key] != b[key]:
                if key in ("outputs", "live", "deadlines") and hints:
                    why += " (this round: " + "; ".join(hints) + ")"
                shown = a[key] if key != "outputs" else [(o[0], o[2], o[3]) for o in a[key]]
                raise AssertionError(
                    f"{where}, round {i}: your round's {key} is {_short(shown, 300)} after "
                    f"[{ops_text(ops[: round_ends[i] + 1])}]: {why}"
                )
    assert len(got) == len(want), f"{where}: your loop handed back {len(got)} rounds for {len(want)} taken"


@pytest.mark.points(2)
def test_loop_matches_nanolab_round_by_round(lab, rng):
    """your EngineLoop, driven command by command through its handles, hands back nanolab's rounds on random sessions (adds good and bad, requests behind the loop's back, aborts, deadlines, failing steps): acks, refusals, outputs, failures, stats, live requests and deadlines"""
    for trial in range(40):
        ops = random_ops(rng, rng.randint(20, 45))
        where = f"session {trial}"
        compare_sessions(learner_session(lab, ops, where), reference_session(ops), ops, where)


def _session(lab, ops: list, where: str) -> tuple[list[dict], list[dict]]:
    got, want = learner_session(lab, ops, where), reference_session(ops)
    compare_sessions(got, want, ops, where)
    return got, want


def _engine(**kw) -> tuple:
    return ("engine", {"max_num_seqs": 4, "max_model_len": 24, "fail_at": [], **kw})


@pytest.mark.points(1)
def test_add_is_all_or_none(lab, rng):
    """an add with one bad prompt among good ones (empty, a token outside the vocabulary, too long, an id in use) is refused whole: none of its requests runs or is live, and the next good add is accepted"""
    for trial, bad in enumerate(["empty", "vocab", "long", "in use", "twice"]):
        good = [[rng.randint(1, 25) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
        prompts = [list(p) for p in good]
        ids = [f"g{trial}-{i}" for i in range(len(good))]
        spot = rng.randint(0, len(prompts))
        bad_prompt = {"empty": [], "vocab": [1, 26], "long": [1] * 20}.get(bad, [2, 3])
        bad_id = {"in use": "first", "twice": ids[0]}.get(bad, f"b{trial}")
        prompts.insert(spot, bad_prompt)
        ids.insert(spot, bad_id)
        ops = [_engine(), ("add", 0, ["first"], [[4, 5]], [8], 50.0), ("round",),
               ("add", 1, ids, prompts, [8] * len(ids), 50.0), ("round",), ("step",), ("step",), ("round",),
               ("add", 2, [f"ok{trial}"], [[6]], [3], None), ("step",), ("round",)]  # fmt: skip
        got, _ = _session(lab, ops, f"an add of {len(ids)} prompts, one of them bad ({bad})")
        assert got[1]["accepted"] == [] and [x[:2] for x in got[1]["refused"]] == [(1, "invalid")], (
            f"an add of {len(ids)} prompts, one of them bad ({bad}): refused whole, as (add id, 'invalid', ...)"
        )


@pytest.mark.points(1)
def test_aborts_pass_on_one_final_output(lab, rng):
    """abort passes on the final output (finish reason 'abort') of a waiting or running request once; aborting a finished, an already aborted or an unknown request passes nothing, and a request that is not the loop's (put in the engine behind its back) is left alone"""
    for trial in range(10):
        prompts = [[rng.randint(1, 25) for _ in range(rng.randint(1, 5))] for _ in range(5)]
        ids = [f"r{trial}-{i}" for i in range(5)]
        ops = [_engine(max_num_seqs=2), ("direct", "side", [7, 7], 20),
               ("add", 0, ids, prompts, [1, 12, 12, 12, 12], None), ("step",), ("step",),
               ("round",), ("abort", [ids[0], ids[1], ids[4]]), ("round",), ("abort", [ids[1], "nobody", ids[0], "side"]),
               ("round",), ("step",), ("abort", [ids[2], ids[2]]), ("step",), ("step",), ("round",)]  # fmt: skip
        _session(lab, ops, f"aborts of finished, running, waiting, unknown and not live requests ({trial})")


@pytest.mark.points(1)
def test_expire_ends_requests_whose_deadline_has_come(lab, rng):
    """expire(now) ends exactly the live requests whose deadline is now or earlier (a deadline equal to now has come) with finish reason 'timeout', drops their deadlines, and a finished request's deadline is dropped too"""
    for _trial in range(8):
        d = float(rng.randint(2, 9))
        ops = [_engine(max_model_len=60), ("add", 0, ["slow"], [[3, 1]], [40], d), ("add", 1, ["late"], [[2, 2]], [40], d + 4),
               ("add", 2, ["free"], [[4]], [40], None), ("add", 3, ["quick"], [[5, 6]], [1], d - 1),
               ("step",), ("step",), ("round",), ("expire", d - 0.5), ("round",), ("expire", d), ("round",),
               ("step",), ("expire", d + 3.999), ("round",), ("expire", d + 4), ("step",), ("expire", 1e9), ("round",)]  # fmt: skip
        got, _ = _session(lab, ops, f"deadlines {d - 1:g}, {d:g}, {d + 4:g} and none")
        assert [o[2] for o in got[2]["outputs"]] == ["timeout"], (
            f"expire({d:g}) with a request whose deadline is {d:g}: it ends with finish reason 'timeout'"
        )


@pytest.mark.points(1)
def test_failed_step_fails_only_its_live_requests(lab, rng):
    """a step that raises EngineStepError fails each live request it was running once (not one running behind the loop's back, nor a waiting one), counts in step_errors, and the loop goes on serving"""
    for _trial in range(8):
        fail = rng.randint(2, 4)
        ops = [_engine(max_num_seqs=2, fail_at=[fail, fail + 3]), ("direct", "side", [1, 2], 12),
               ("add", 0, ["a", "b"], [[3], [4, 4]], [12, 12], 90.0), ("step",), ("round",)]  # fmt: skip
        ops += (
            [("step",), ("round",)] * 6 + [("add", 1, ["c"], [[5]], [4], None)] + [("step",), ("round",)] * 6
        )
        got, _ = _session(lab, ops, f"steps {fail} and {fail + 3} fail")
        assert sum(r["step_errors"] for r in got) == 2, f"steps {fail} and {fail + 3} fail: count them"


# ---------------------------------------------------------------------------------------------- quantiles


def random_histogram(rng) -> list[tuple[float, float]]:
    bounds = sorted(
        rng.sample([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10], rng.randint(0, 7))
    )
    count, buckets = 0, []
    for b in [*bounds, INF]:
        count += rng.choice([0, 0, 0, 1, 2, 3, 7, 100])
        buckets.append((b, count if rng.random() < 0.7 else float(count)))
    return buckets


def quantile_close(a, b) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    return (
        isinstance(a, (int, float))
        and not isinstance(a, bool)
        and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    )


@pytest.mark.points(1)
def test_quantile_matches_nanolab(lab, rng):
    """histogram_quantile agrees with nanolab's on random histograms and quantiles (ranks on bucket edges, empty buckets before, between and after, the +Inf bucket, q = 0 and q = 1, an empty histogram)"""
    cases = []
    for _ in range(300):
        buckets = random_histogram(rng)
        total = buckets[-1][1]
        qs = [0.0, 1.0, 0.5, 0.9, 0.99, rng.random()]
        if total:  # ranks exactly on a bucket's cumulative count
            qs += [c / total for _, c in rng.sample(buckets, min(2, len(buckets)))]
        cases.append((rng.choice(qs), buckets))
    cases += [
        (0.5, [(0.1, 0), (INF, 0)]),
        (0.5, [(INF, 5)]),
        (0.0, [(0.1, 0), (0.2, 0), (0.4, 10), (INF, 10)]),
        (1.0, [(0.1, 4), (0.2, 4), (INF, 4)]),
        (0.5, [(0.1, 2), (0.2, 2), (0.3, 4), (INF, 4)]),
        (0.99, [(0.1, 50), (1.0, 99), (INF, 100)]),
        (1.0, [(0.1, 1), (0.2, 1), (INF, 3)]),
    ]
    for q, buckets in cases:
        want = histogram_quantile(q, buckets)
        try:
            got = lab.histogram_quantile(q, buckets)
        except RemoteError as e:
            raise AssertionError(f"histogram_quantile({q!r}, {buckets}) raised {e.type_name}") from None
        assert quantile_close(got, want), (
            f"histogram_quantile({q!r}, {buckets}) = {got!r}: find the first bucket whose count reaches the rank "
            "q * total (skipping buckets that hold none) and interpolate from its lower bound; the +Inf bucket "
            "gets the largest finite bound, an empty histogram NaN"
        )


@pytest.mark.points(1)
def test_quantile_refuses_a_bad_q_or_no_inf_bucket(lab, rng):
    """histogram_quantile raises ValueError for a q outside [0, 1] (NaN included) and for buckets whose last bound is not +Inf"""
    buckets = random_histogram(rng)
    for q in (-0.1, 1.5, -INF, INF, NAN, 1 + 1e-12):
        expect_value_error(
            lambda q=q: lab.histogram_quantile(q, buckets), f"histogram_quantile({q!r}, {buckets})"
        )
    for bad in ([(0.1, 1), (0.2, 1)], [(0.1, 0)], [(INF, 2), (0.5, 2)]):
        expect_value_error(
            lambda bad=bad: lab.histogram_quantile(0.5, bad), f"histogram_quantile(0.5, {bad})"
        )
