"""Hidden tests for Lab 8's front door: `parse_chat_request` against nanolab's on random chat bodies good and
bad, `chat_events` against nanolab's `stream_chat`, `Admission` against nanolab's on random traces and under
threads racing for the last places, and `observe_output` / `observe_stats` against nanolab's `ServerMetrics`.

As in test_lab08.py, everything of the learner's is driven from here through the `lab` fixture: bodies cross
as data, outputs and snapshots are built with the setup's classes, every call and read-back goes through a
handle, and nanolab's pieces run here on the same inputs; the two are compared as plain data. A refusal's
``param`` and a `ServerOverloaded`'s ``retry_after`` are read off the exception the learner's code raised,
kept by the standard library's ``unittest`` (`ExceptionCatcher`), so no code of the notebook stands in between.

The race. Calls through handles go one at a time (the sandbox has one pipe), so threads here could never
make the learner's `admit` run twice at once. The threads are made in the sandbox instead, from the standard
library alone, built here through handles (`_SandboxRace`): a `concurrent.futures.ThreadPoolExecutor` of 8
workers, and for each of 300 fresh admissions 8 tasks that meet at a `threading.Barrier` of that admission
and then call ``admit(1)`` until it refuses (an iterator of ones mapped through ``admit``), with the interpreter
told to switch threads as often as it can. How far each task got is read back from its iterator. Under
CPython's GIL a check and a count with no call between them could not be split, so each max_waiting is an int
whose comparisons first give up the GIL (``time.sleep(0)``), as the visible check's do: comparing with the
limit is a point where another thread runs, as it may anywhere in a busier or a free-threaded interpreter. The
class is made in the sandbox by ``exec`` of `_YIELDING_LIMIT` in a module of its own. A check and a count that
are not one step under a lock then let one place too many through at nearly every admission, on one core as on
many (comparisons that only made the interpreter switch threads when its switch interval ran out missed it in
about one run in three on one core); a correct admission is exact every time. Feedback says what is wrong and on which input, never the expected
answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from types import SimpleNamespace

import pytest

from autograder.testing import ExceptionCatcher, Remote, RemoteError, expect
from labkit.lab08 import MetricSet as SetupMetricSet
from nanolab.engine.core import EngineStepError as NanolabStepError
from nanolab.engine.outputs import CompletionOutput as NanolabCompletion
from nanolab.engine.outputs import RequestOutput as NanolabOutput
from nanolab.model.sampling import SamplingParams as NanolabParams
from nanolab.serving import chat_protocol, openai_protocol, responses
from nanolab.serving.async_engine import Admission as NanolabAdmission
from nanolab.serving.async_engine import RequestGroup
from nanolab.serving.async_engine import ServerOverloaded as NanolabOverloaded
from nanolab.serving.metrics import ServerMetrics

MODEL = "tinypy"
INF, NAN = math.inf, math.nan


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def _raised(e: RemoteError) -> str:
    """What the learner's code raised, as its type and the start of its message."""
    return f"{e.type_name}: {e.message[:200]}" if e.message else e.type_name


# ---------------------------------------------------------------------------------------------- chat bodies

# Values each sampling field may take in a valid body (absent is also drawn); the seeds fit 64 bits with n.
GOOD = {
    "model": [None, MODEL],
    "max_tokens": [None, 1, 2, 16, 200, 10**30],
    "max_completion_tokens": [None, 1, 3, 16, 500, 10**30],
    "temperature": [None, 0, 0.0, 0.7, 1, 2.5, 10**30],
    "top_p": [None, 1, 1.0, 0.5, 1e-9],
    "n": [None, 1, 2, 3, 5],
    "seed": [None, 0, -7, 42, -(2**63), 2**64 - 8],
    "stop": [None, "\n", "é", [], ["#"], ["a", "\n\n"]],
    "stream": [None, True, False],
}
GOOD_OPTIONS = [
    {},
    {"include_usage": True},
    {"include_usage": False},
    {"include_usage": None},
    {"x_extra": 1},
]
# `prompt` is not a chat field: ignored like any unknown field, whatever its value (good or bad for completions).
PROMPTS = ["def f", [1, 2], None, "", [], 3, {"a": 1}, [[1], "a"], True]
# Field names nanolab's chat does not know either (it knows more than the lab: logprobs, user, priority, ...).
UNKNOWN = [
    "x_foo",
    "zz_tag",
    "a_custom",
    "vendor_opt",
    "Messages",
    "MAX_TOKENS",
    "extra_body",
    "metadata_x",
    "_",
]
JUNK = [None, 1, "x", NAN, [1, [2]], {"k": {"l": []}}, True, -INF]
ROLES = ["system", "user", "assistant", "tool", "developer", "x"]
TEXT = "def f(x):\n é😀#"

# One message that is bad on its own (put among good ones): what nanolab refuses naming "messages".
BAD_MESSAGE = [
    None, "hi", [], 3, True, {"content": "x"}, {"role": "", "content": "x"}, {"role": 3, "content": "x"},
    {"role": None, "content": "x"}, {"role": ["user"], "content": "x"}, {"role": True, "content": "x"},
    {"role": "user"}, {"role": "user", "content": None}, {"role": "user", "content": 3},
    {"role": "user", "content": True}, {"role": "user", "content": {"type": "text", "text": "x"}},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
    {"role": "user", "content": [{"type": "text", "text": 1}]},
    {"role": "user", "content": [{"type": "text", "text": None}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": [{"text": "a"}]},
    {"role": "user", "content": [{"type": "TEXT", "text": "a"}]},
    {"role": "user", "content": ["x"]},
    {"role": "user", "content": [None]},
    {"role": "user", "content": [[{"type": "text", "text": "a"}]]},
]  # fmt: skip
# A whole "messages" value that is bad (None: absent, or null).
BAD_MESSAGES = [None, [], "hi", 3, True, {"role": "user", "content": "x"}, {}]
BAD = {
    "max_completion_tokens": [0, -1, 1.5, 2.0, True, False, "8", INF, NAN, [8], {}],
    "max_tokens": [0, -1, 2.0, True, "16", NAN, [16]],  # only while max_completion_tokens is absent or null
    "temperature": [-0.5, INF, NAN, True, "1", 10**400],
    "top_p": [0, 1.01, NAN, True, "0.5"],
    "n": [0, 1.5, True, "2"],
    "seed": [1.5, "1", True, 2**64, -(2**63) - 1],
    "stop": ["", ["a", ""], [1], 3, True],
    "stream": [1, 0, "true"],
    "model": ["gpt-4", "", "TINYPY", 3, False],
}
BAD_OPTIONS = [0, "x", [], {"include_usage": "yes"}, {"include_usage": 1}]  # with stream true
NOT_OBJECTS = [None, [], "messages", 3, 1.5, True, [{"messages": []}]]


def random_text(rng, most: int = 8) -> str:
    return "".join(rng.choice(TEXT) for _ in range(rng.randint(0, most)))


def random_message(rng) -> dict:
    """A valid message: a role and a content (a string, or text parts), some with keys nanolab passes on."""
    if rng.random() < 0.6:
        content = random_text(rng)
    else:
        content = [{"type": "text", "text": random_text(rng, 4)} for _ in range(rng.randint(0, 3))]
        if content and rng.random() < 0.3:
            content[0]["cache_control"] = {"type": "ephemeral"}
    message = {"role": rng.choice(ROLES), "content": content}
    if rng.random() < 0.2:
        message["name"] = "ann"
    return message


def good_chat_body(rng) -> dict:
    """A valid chat body: messages, a random subset of the other fields with good values, prompt and unknown
    fields, in any order."""
    fields = {"messages": [random_message(rng) for _ in range(rng.randint(1, 4))]}
    for name, values in GOOD.items():
        if rng.random() < 0.5:
            fields[name] = rng.choice(values)
    if rng.random() < 0.4:
        fields["stream_options"] = rng.choice(GOOD_OPTIONS if fields.get("stream") is True else [None, {}])
    if rng.random() < 0.3:
        fields["prompt"] = rng.choice(PROMPTS)
    for name in rng.sample(UNKNOWN, rng.choice([0, 0, 1, 2])):
        fields[name] = rng.choice(JUNK)
    names = list(fields)
    rng.shuffle(names)
    return {name: fields[name] for name in names}


def bad_chat_bodies(rng) -> list[tuple[dict, str]]:
    """Each bad value once, in an otherwise valid random body: (body, the field at fault), the conversation's
    faults first."""
    cases = []
    for message in BAD_MESSAGE:
        body = good_chat_body(rng)
        body["messages"].insert(rng.randint(0, len(body["messages"])), message)
        cases.append((body, "messages"))
    for value in BAD_MESSAGES:
        body = good_chat_body(rng)
        if value is None:
            body.pop("messages") if rng.random() < 0.5 else body.update(messages=None)
        else:
            body["messages"] = value
        cases.append((body, "messages"))
    for name, values in BAD.items():
        for i, value in enumerate(values):
            body = good_chat_body(rng)
            if name == "max_tokens":  # the newer name wins: a bad max_tokens counts only without it
                body.pop("max_completion_tokens", None) if i % 2 else body.update(max_completion_tokens=None)
            if name == "max_completion_tokens":  # named as sent, also when max_tokens is sent beside it
                body.pop("max_tokens", None) if i % 2 else body.update(max_tokens=rng.choice([1, 16, 10**30]))
            body[name] = value
            cases.append((body, name))
    for value in BAD_OPTIONS:
        body = good_chat_body(rng)
        body.update(stream=True, stream_options=value)
        cases.append((body, "stream_options"))
    body = good_chat_body(rng)
    body.pop("stream", None)
    body["stream_options"] = {"include_usage": True}
    cases.append((body, "stream_options"))
    return cases  # in this order, so that one mistake is reported by the same rule whatever the bodies


def reference_chat(body) -> tuple:
    """nanolab's verdict on a chat body: ("ok", fields) or ("refused", param)."""
    try:
        r = chat_protocol.parse_chat_request(body, MODEL)
    except openai_protocol.InvalidRequest as e:
        return ("refused", e.param)
    p = r.params
    return ("ok", dict(messages=[(m["role"], m["content"]) for m in r.messages], max_tokens_given=r.max_tokens_given,
                       max_tokens=p.max_tokens if r.max_tokens_given else None, temperature=p.temperature,
                       top_p=p.top_p, n=p.n, stop=p.stop, seed=p.seed, stream=r.stream,
                       include_usage=r.include_usage, ignored=list(r.ignored), model=r.model))  # fmt: skip


CHAT_HINTS = {
    "messages": "messages: one {'role', 'content'} per message, in order, its content as one string "
    "(the texts of its parts joined with '\\n')",
    "max_tokens_given": "max_tokens_given: whether max_tokens or max_completion_tokens was given (not null)",
    "max_tokens": "max_tokens: max_completion_tokens when given (it wins over max_tokens), else max_tokens",
    "temperature": "temperature: the body's value, or 1.0 when it is absent or null",
    "top_p": "top_p: the body's value, or 1.0 when it is absent or null",
    "n": "n: the body's value, or 1 when it is absent or null",
    "stop": "stop: None when absent or null, otherwise always a list (one string becomes a list of one)",
    "seed": "seed: the body's value, or None",
    "stream": "stream: the body's true or false, false when absent or null",
    "include_usage": "include_usage: stream_options.include_usage as true or false (absent or null: false)",
    "ignored": "ignored: the names of the body's fields outside CHAT_FIELDS (prompt is one of them), sorted",
    "model": "model: the name of the model served",
}


def learner_chat(lab, body, request) -> dict:
    """The learner's ChatRequest for ``body``, read back field by field through its handles."""
    where = f"parse_chat_request({_short(body)}, {MODEL!r})"
    if not isinstance(request, Remote) or request.type_name != "ChatRequest":
        got = request.type_name if isinstance(request, Remote) else type(request).__name__
        raise AssertionError(f"{where} should return a ChatRequest, not {got}")
    try:
        p, given = request.params, request.max_tokens_given
        messages = expect(request.messages, list, f"{where}: its messages")
        pairs = []
        for m in messages:
            m = expect(m, dict, f"{where}: each of its messages")
            pairs.append((m.get("role"), m.get("content")))
        return dict(messages=pairs, max_tokens_given=given, max_tokens=p.max_tokens if given is True else None,
                    temperature=p.temperature, top_p=p.top_p, n=p.n, stop=p.stop, seed=p.seed,
                    stream=request.stream, include_usage=request.include_usage, ignored=request.ignored,
                    model=request.model)  # fmt: skip
    except RemoteError as e:
        raise AssertionError(f"{where}: reading the request's fields back raised {e.type_name}") from None


def check_chat_accepted(lab, body: dict, want: dict) -> None:
    where = f"the valid chat body {_short(body)}"
    try:
        request = lab.parse_chat_request(body, MODEL)
    except RemoteError as e:
        raise AssertionError(f"{where} was refused ({_raised(e)}): it is a valid request") from None
    got = learner_chat(lab, body, request)
    for key, hint in CHAT_HINTS.items():
        a, b = got[key], want[key]
        if key in ("ignored", "stop") and isinstance(a, (list, tuple)):
            a = list(a)
        strict = key in ("stream", "include_usage", "max_tokens_given")
        same = a == b and type(a) is type(b) if strict else a == b
        assert same and not (isinstance(a, bool) and not isinstance(b, bool)), (
            f"{where}: its {key} is {_short(got[key], 160)}: {hint}"
        )


def check_chat_refused(lab, catcher: ExceptionCatcher, body, param, what: str) -> None:
    exc = catcher.raised(lab.parse_chat_request, body, MODEL)
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
    if param is None:
        why = "a body that is not an object has param None"
    elif param == "max_completion_tokens":
        why = "a bad max_completion_tokens is refused under the name the client sent, max_completion_tokens"
    elif param == "messages":
        why = "every fault in the conversation is refused naming 'messages'"
    else:
        why = "param names the field at fault"
    assert got == param, f"{what} {_short(body)}: yours refused it naming param {got!r}: {why}"


@pytest.mark.points(1)
def test_chat_parse_builds_the_same_request_as_nanolab(lab, rng):
    """parse_chat_request turns random valid chat bodies (string and text-part contents, max_tokens and max_completion_tokens, a prompt and unknown fields to ignore, any order) into nanolab's request: messages, sampling fields, stream options, ignored fields"""
    for _ in range(100):
        body = good_chat_body(rng)
        verdict = reference_chat(body)
        assert verdict[0] == "ok", f"the test made a chat body nanolab refuses: {body}"  # a bug of the test
        check_chat_accepted(lab, body, verdict[1])


@pytest.mark.points(1)
def test_chat_parse_refuses_a_bad_field_naming_it(lab, rng):
    """parse_chat_request refuses a bad conversation (no messages, a message without a role or content, an image or other non-text part) naming messages, a bad max_completion_tokens under that name, a bad completions field under its own name, and a body that is not an object with param None"""
    catcher = ExceptionCatcher(lab)
    for body, field in bad_chat_bodies(rng):
        assert reference_chat(body) == ("refused", field), (
            f"the test made a chat body nanolab does not refuse as planned: {body}"
        )
        check_chat_refused(lab, catcher, body, field, "the chat body")
    for body in NOT_OBJECTS:
        assert reference_chat(body) == ("refused", None)
        check_chat_refused(lab, catcher, body, None, "the chat body that is not a JSON object,")


# ---------------------------------------------------------------------------------------------- the chat stream

REASONS = ["stop", "length", "abort", "timeout"]


def _sample(index, text, ids, reason, delta, delta_ids) -> tuple:
    return (index, text, list(ids), reason, delta, list(delta_ids))


def random_chat_stream(rng) -> tuple[list, int]:
    """A chat request's items as plain data, in the order steps would make them: ("out", request id, prompt
    token ids, samples, finished) with samples (index, text, token ids, finish reason, delta text, delta token
    ids), or ("error", message). Finish reasons arrive at different steps and are repeated afterwards; some
    outputs have new tokens but no new text (held back), some none at all; some streams fail, and some have
    items after their end."""
    n = rng.randint(1, 3)
    prompt = [rng.randint(1, 99) for _ in range(rng.randint(1, 7))]
    text, ids, reason = [""] * n, [[] for _ in range(n)], {}
    items, fails = [], rng.random() < 0.25
    while True:
        samples = []
        for s in range(n):
            new_ids, new_text = [], ""
            if s not in reason:
                new_ids = [rng.randint(0, 999) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
                if new_ids and rng.random() < 0.8:
                    new_text = "".join(rng.choice('xyz é😀\n"\\') for _ in range(rng.randint(1, 3)))
                if rng.random() < 0.3:
                    reason[s] = rng.choice(REASONS)
            text[s] += new_text
            ids[s] += new_ids
            samples.append(_sample(s, text[s], ids[s], reason.get(s), new_text, new_ids))
        finished = len(reason) == n
        items.append(("out", "chatcmpl-x-0", prompt, samples, finished))
        if fails and rng.random() < 0.3:
            items.insert(len(items) - rng.randint(0, 1), ("error", "the model runner failed"))
            break
        if finished:
            break
    if rng.random() < 0.3:  # items after the end are never read
        after = [_sample(s, "late", [1], "stop", "late", [1]) for s in range(n)]
        items.append(rng.choice([("error", "too late"), ("out", "chatcmpl-x-0", prompt, after, True)]))
    return items, n


def fixed_chat_streams() -> list[tuple[list, int, bool, str]]:
    """Streams that each show one rule, sent before the random ones: (items, n, include_usage, what)."""
    p = [5, 6, 7]
    out = "out", "chatcmpl-x-0", p
    return [
        ([(*out, [_sample(0, "ab", [1, 2], None, "ab", [1, 2])], False),
          (*out, [_sample(0, "abc", [1, 2, 3], "stop", "c", [3])], True)], 1, False,
         "one sample: text, then more text and its finish"),
        ([(*out, [_sample(0, "x", [1], None, "x", [1]), _sample(1, "", [4], None, "", [4])], False),
          (*out, [_sample(0, "x", [1, 2], "length", "", [2]), _sample(1, "yz", [4, 5], None, "yz", [5])], False),
          (*out, [_sample(0, "x", [1, 2], "length", "", []), _sample(1, "yzw", [4, 5, 6], "stop", "w", [6])], True)],
         2, True, "two samples, usage: text held back, a finish without text, repeated after"),
        ([(*out, [_sample(0, "ab", [1, 2], None, "ab", [1, 2])], False), ("error", "the model runner failed"),
          (*out, [_sample(0, "abc", [1, 2, 3], "stop", "c", [3])], True)], 1, True,
         "a failed step after one output, an output after it"),
        ([("error", "step 1 failed")], 3, False, "three samples, the first step fails"),
        ([(*out, [_sample(0, "ok", [3, 4], "stop", "ok", [3, 4])], True), ("error", "too late")], 1, True,
         "one output with text and its finish at once, usage, an error after the end"),
    ]  # fmt: skip


def reference_chat_events(items, cid, created, n, include_usage) -> list[str]:
    """The events nanolab's server streams for these items, one queued item read at a time."""

    def convert(item):
        if item[0] == "error":
            return NanolabStepError(item[1], [])
        _, rid, prompt, samples, finished = item
        outputs = [NanolabCompletion(i, t, list(x), r, d, list(dx)) for i, t, x, r, d, dx in samples]
        return NanolabOutput(rid, None, list(prompt), outputs, finished, None)

    class Client:  # what stream_chat asks of the engine client
        tokenizer = None

        def abort(self, request_ids):
            pass

    request = chat_protocol.ChatRequest([], NanolabParams(n=n), True, MODEL, True, include_usage)

    async def collect():
        group = RequestGroup(cid, 1, asyncio.get_running_loop())
        for item in items:
            group.queue.put_nowait((0, convert(item)))
        return [event async for event in responses.stream_chat(Client(), group, request)]

    async def one_at_a_time(group):
        return [await group.queue.get()]

    saved = responses._ready_items, openai_protocol.now
    responses._ready_items, openai_protocol.now = one_at_a_time, lambda: created
    try:
        chunks = asyncio.run(collect())
    finally:
        responses._ready_items, openai_protocol.now = saved
    return [e for chunk in chunks for e in re.findall(r"data: .*?\n\n", chunk, re.S)]


def learner_chat_items(lab, items) -> list:
    """The items built in the sandbox with the setup's classes: RequestOutput or EngineStepError."""
    built = []
    for item in items:
        if item[0] == "error":
            built.append(lab.EngineStepError(item[1]))
            continue
        _, rid, prompt, samples, finished = item
        outputs = [lab.CompletionOutput(i, t, x, r, d, dx) for i, t, x, r, d, dx in samples]
        built.append(lab.RequestOutput(rid, prompt, outputs, finished))
    return built


def parse_events(events: list, where: str) -> list:
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


def _delta(event):
    """The delta of a chunk with one choice, else None."""
    if isinstance(event, dict) and isinstance(event.get("choices"), list) and len(event["choices"]) == 1:
        choice = event["choices"][0]
        return choice.get("delta") if isinstance(choice, dict) else None
    return None


def chat_hint(a, b) -> str:
    """The rule the learner's event ``a`` broke where nanolab sends ``b``, worded by the rule, not the data."""
    if isinstance(b, dict) and "error" in b:
        return "a failed step ends the stream with the error event (type server_error), then [DONE]"
    if b == "[DONE]":
        return (
            "the stream is over once the request has finished (or an error came): then [DONE], nothing more"
        )
    if isinstance(b, dict) and b.get("choices") == []:
        return (
            "the usage chunk (choices []) comes once the request has finished: the prompt's tokens, every "
            "sample's output tokens"
        )
    if isinstance(a, dict) and isinstance(b, dict) and set(a) != set(b):
        return "a chunk has id, object, created, model, choices (and usage: null on every chunk with include_usage)"
    mine, theirs = _delta(a), _delta(b)
    if any(isinstance(d, dict) and "role" in d for d in (mine, theirs)):
        return "first, before any output, one chunk per choice 0 .. n - 1 whose delta is the role (assistant, content '')"
    finish = (
        a["choices"][0].get("finish_reason")
        if mine is not None and isinstance(a["choices"][0], dict)
        else None
    )
    if isinstance(mine, dict) and "content" in mine and (mine["content"] == "" or finish is not None):
        return (
            "a sample's new text goes out as the delta {'content': its delta_text} with finish reason None, one "
            "chunk per sample that has new text"
        )
    if mine == {} or theirs == {}:
        return "a sample's finish reason goes out once, on a chunk of its own whose delta is {}, after its new text"
    return (
        "a sample's new text goes out as the delta {'content': its delta_text} with finish reason None, one chunk "
        "per sample that has new text, in the order of the samples"
    )


def compare_chat_events(got: list, want: list, where: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            raise AssertionError(f"{where}, event {i}: yours is {_short(a, 200)}: {chat_hint(a, b)}")
    assert len(got) == len(want), (
        f"{where}: yours sent {len(got)} events: the role chunks, one chunk per new text, one per new finish, "
        "the usage chunk when asked, the error event on a failed step, and [DONE] last"
    )


def describe_chat_stream(items, n, usage) -> str:
    failed = any(item[0] == "error" for item in items)
    return f"n={n}, include_usage {usage}, {len(items)} items" + (
        ", one of them a failed step" if failed else ""
    )


@pytest.mark.points(1)
def test_chat_events_match_nanolab_stream(lab, rng):
    """chat_events sends nanolab's chat chunks on fixed and random streams (n up to 3, finish reasons at different steps and repeated after, text held back, usage on and off, a failed step, items after the end), compared event by event as JSON"""
    cases = [(items, n, usage, what) for items, n, usage, what in fixed_chat_streams()]
    for _ in range(80):
        items, n = random_chat_stream(rng)
        usage = rng.random() < 0.5
        cases.append((items, n, usage, describe_chat_stream(items, n, usage)))
    for trial, (items, n, usage, what) in enumerate(cases):
        cid, created = f"chatcmpl-{rng.randrange(10**6)}", rng.randint(1_600_000_000, 1_800_000_000)
        want = parse_events(reference_chat_events(items, cid, created, n, usage), "nanolab")
        where = f"stream {trial} ({what})"
        try:
            events = lab.chat_events(learner_chat_items(lab, items), cid, MODEL, created, n, usage)
        except RemoteError as e:
            raise AssertionError(f"{where}: your chat_events raised {_raised(e)}") from None
        got = parse_events(expect(events, list, f"chat_events(...) on {where}"), where)
        compare_chat_events(got, want, where)


# ---------------------------------------------------------------------------------------------- admission

ADMIT_HINTS = {
    "refuse": "admit refuses (ServerOverloaded, counting nothing) once waiting >= max_waiting, where waiting "
    "counts the adds sent since the last round too",
    "admit": "admit lets an add through while waiting < max_waiting (max_waiting None: no limit), however many "
    "prompts it has",
    "retry_after": "ServerOverloaded(message, retry_after) carries the retry_after the Admission was made with",
    "waiting": "waiting = engine_waiting + sent - handled, with the last round's handled and engine_waiting "
    "(both 0 before the first round): an add let through counts its prompts, a refused one nothing",
}


def fixed_admission_ops() -> list:
    return [("make", 2, 3), ("admit", 1), ("admit", 1), ("admit", 1), ("round", 2, 2), ("admit", 1),
            ("round", 2, 0), ("admit", 5), ("admit", 1), ("round", 4, 3), ("admit", 2), ("round", 7, 2),
            ("round", 7, 0), ("admit", 1)]  # fmt: skip


def random_admission_ops(rng) -> list:
    """A trace as the HTTP side sees it: adds asked for, and rounds reporting how many prompts the engine side
    had taken off its queue (ever) and how many requests wait in the engine. What the engine side takes is
    decided as it goes (by nanolab's answers), so the trace is made while nanolab's Admission plays it."""
    return [("make", rng.choice([None, 1, 2, 3, 5, 8]), rng.randint(1, 30))]


def op_text(op) -> str:
    if op[0] == "make":
        return f"Admission(max_waiting={op[1]}, retry_after={op[2]})"
    if op[0] == "admit":
        return f"admit({op[1]})"
    return f"on_round(handled={op[1]}, engine_waiting={op[2]})"


def trace_text(ops) -> str:
    text = "; ".join(op_text(op) for op in ops)
    return text if len(text) < 700 else op_text(ops[0]) + "; ...; " + text[-640:]


class _Engine:
    """The engine side of the trace: the prompts of the adds sent and not yet taken, and its waiting count."""

    def __init__(self) -> None:
        self.queue, self.handled, self.waiting = [], 0, 0

    def next_op(self, rng):
        r = rng.random()
        if r < 0.45:
            return ("admit", rng.choice([1, 1, 1, 2, 3, 5]))
        if r < 0.65 and self.queue:  # it takes some adds off its queue (unseen here until a round)
            for _ in range(rng.randint(1, len(self.queue))):
                k = self.queue.pop(0)
                self.handled, self.waiting = self.handled + k, self.waiting + k
            return None
        if r < 0.8:  # it admits some of its waiting requests into the batch
            self.waiting -= rng.randint(0, self.waiting)
            return None
        return ("round", self.handled, self.waiting)


def learner_admit(lab, catcher: ExceptionCatcher, admission, k: int, where: str) -> tuple:
    """("admitted",) or ("refused", retry_after), read off what the learner's admit did."""
    try:
        exc = catcher.raised(admission.admit, k)
    except RemoteError as e:
        raise AssertionError(f"{where}: your admit raised {_raised(e)}") from None
    if exc is None:
        return ("admitted",)
    assert exc.type_name == "ServerOverloaded", (
        f"{where}: your admit raised {exc.type_name}: refuse with the setup's ServerOverloaded(message, retry_after)"
    )
    return ("refused", exc.retry_after)


def play_admission(lab, catcher, ops: list, rng=None, steps: int = 0) -> None:
    """Play ``ops`` (and, with ``rng``, ``steps`` more made as it goes) on nanolab's Admission and the
    learner's, comparing what each add got and the waiting count after every call."""
    _, limit, retry = ops[0]
    played = [ops[0]]
    try:
        mine = lab.Admission(limit, retry)
        waiting = mine.waiting
    except RemoteError as e:
        raise AssertionError(f"{op_text(ops[0])}: yours raised {_raised(e)}") from None
    ref = NanolabAdmission(limit, retry)
    assert waiting == 0 and type(waiting) is int, (
        f"{op_text(ops[0])}: your waiting is {_short(waiting, 80)} before anything: {ADMIT_HINTS['waiting']}"
    )
    engine = _Engine()
    todo = list(ops[1:])
    while todo or (rng is not None and steps > 0):
        if todo:
            op = todo.pop(0)
        else:
            steps -= 1
            op = engine.next_op(rng)
            if op is None:
                continue
        played.append(op)
        where = f"after [{trace_text(played)}]"
        if op[0] == "admit":
            try:
                ref.admit(op[1])
                want = ("admitted",)
                engine.queue.append(op[1])
            except NanolabOverloaded as e:
                want = ("refused", e.retry_after)
            got = learner_admit(lab, catcher, mine, op[1], where)
            if got[0] != want[0]:
                did = "let the add through" if got[0] == "admitted" else "refused the add"
                hint = ADMIT_HINTS["refuse" if want[0] == "refused" else "admit"]
                raise AssertionError(f"{where}: yours {did}: {hint}")
            assert got == want, (
                f"{where}: your ServerOverloaded says retry_after {got[1]!r}: {ADMIT_HINTS['retry_after']}"
            )
        else:
            ref.on_round(op[1], op[2])
            try:
                mine.on_round(op[1], op[2])
            except RemoteError as e:
                raise AssertionError(f"{where}: your on_round raised {_raised(e)}") from None
        try:
            waiting = mine.waiting
        except RemoteError as e:
            raise AssertionError(f"{where}: reading your waiting raised {_raised(e)}") from None
        assert waiting == ref.waiting and type(waiting) is int, (
            f"{where}: your waiting is {_short(waiting, 80)}: {ADMIT_HINTS['waiting']}"
        )


@pytest.mark.points(1)
def test_admission_counts_like_nanolab(lab, rng):
    """Admission admits and refuses what nanolab's admits and refuses on a fixed trace and random ones (limits 1 to 8 and none, adds of several prompts, rounds reporting what the engine took and admitted), with the same retry_after and the same waiting count after every call"""
    catcher = ExceptionCatcher(lab)
    play_admission(lab, catcher, fixed_admission_ops())
    for _ in range(30):
        play_admission(lab, catcher, random_admission_ops(rng), rng, rng.randint(30, 70))


# max_waiting for the race: an int whose comparisons let another thread run first (the GIL is given up while
# sleeping), then compare as int's do.
_YIELDING_LIMIT = """
import time


def _yielding(compare):
    def method(self, other):
        time.sleep(0)
        return compare(self, other)

    return method


class YieldingLimit(int):
    __lt__, __le__, __gt__, __ge__ = map(_yielding, (int.__lt__, int.__le__, int.__gt__, int.__ge__))
"""


class _SandboxRace:
    """Threads in the sandbox racing for the places of the learner's Admissions, built here through handles from
    the standard library and `_YIELDING_LIMIT` (see the module docstring). Everything is made in bulk (a few calls in all, however
    many admissions), and kept in the sandbox until the counts are read back."""

    def __init__(self, lab) -> None:
        self.lab = lab
        self.sys = lab.logging.sys
        modules = lab.ref(self.sys, "modules")
        load = modules.get("importlib").import_module
        self.b, self.it, self.op = modules.get("builtins"), load("itertools"), load("operator")
        self.futures, self.functools, self.deque = (
            load("concurrent.futures"),
            load("functools"),
            load("collections").deque,
        )
        # `_YIELDING_LIMIT`, made in a module of its own: the check against the limit is then a point where
        # another thread runs, so a check and a count that are not one step race.
        module = load("types").ModuleType("nanolab_race")
        self.b.exec(_YIELDING_LIMIT, lab.ref(module, "__dict__"))
        self.limit = module.YieldingLimit

    def run(self, limits: list[int], threads: int, tries: int) -> list[tuple[int, int]]:
        """A fresh Admission(limit, 1) per limit (a `YieldingLimit`); for each in turn, ``threads`` workers that meet at a barrier of
        its own, then each call ``admit(1)`` until it refuses (at most ``tries`` times), all at once. Returns, per
        admission, how many calls it let through and its waiting count after."""
        b, it, op, lab = self.b, self.it, self.op, self.lab
        n, count = len(limits), len(limits) * threads
        admissions = self.deque(b.map(lab.Admission, b.map(self.limit, limits), it.repeat(1, n)))
        gates = b.map(lab.threading.Barrier, it.repeat(threads, n), it.repeat(None, n), it.repeat(20, n))
        # per task, in order: each admission's barrier and admit, ``threads`` times over
        waits = it.chain.from_iterable(
            b.map(it.repeat, b.map(op.attrgetter("wait"), gates), it.repeat(threads, n))
        )
        admits = it.chain.from_iterable(
            b.map(it.repeat, b.map(op.attrgetter("admit"), admissions), it.repeat(threads, n))
        )
        # what each task admits from: how far it got is read back from it (its length hint)
        ones = self.deque(b.map(b.iter, it.repeat([1] * tries, count)))
        # a task: wait at its admission's barrier (the value it returns is dropped), then admit(1) until refused
        heads = b.map(it.compress, b.map(it.islice, b.map(b.iter, waits, it.repeat(None, count)), it.repeat(1, count)),
                      it.repeat(it.repeat(0), count))  # fmt: skip
        bodies = b.map(it.chain, heads, b.map(b.map, admits, ones))
        pool = self.futures.ThreadPoolExecutor(threads)
        submit = self.functools.partial(pool.submit, self.functools.partial(self.deque, maxlen=0))
        saved = self.sys.getswitchinterval()
        self.sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: races show
        try:
            tasks = self.deque(b.map(submit, bodies))
        finally:
            pool.shutdown(True)
            self.sys.setswitchinterval(saved)
        ends = b.list(b.map(op.attrgetter("__class__.__name__"), b.map(self.futures.Future.exception, tasks)))
        left = b.list(b.map(op.length_hint, ones))
        waiting = b.list(b.map(op.attrgetter("waiting"), admissions))
        other = sorted(set(ends) - {"NoneType", "ServerOverloaded"})
        assert not other, (
            f"your admit raised {other} while threads asked at once: refuse with ServerOverloaded only"
        )
        through = [tries - k - (end != "NoneType") for k, end in zip(left, ends)]
        return [(sum(through[i * threads : (i + 1) * threads]), waiting[i]) for i in range(n)]


@pytest.mark.points(1)
def test_admission_lets_exactly_max_waiting_through_racing_threads(lab, rng):
    """Admission lets exactly max_waiting one-prompt adds through when 8 threads of the sandbox ask at once, each until it is refused, for the places of each of 300 fresh admissions (a check and its count are one step under a lock)"""
    limits = [rng.choice([1, 2, 3, 5]) for _ in range(300)]
    try:
        got = _SandboxRace(lab).run(limits, 8, 12)
    except RemoteError as e:
        raise AssertionError(
            f"Admission(max_waiting, 1) and its admit, in threads: yours raised {_raised(e)}"
        ) from None
    wrong = [
        (limit, through, waiting)
        for limit, (through, waiting) in zip(limits, got)
        if through != limit or waiting != limit
    ]
    if wrong:
        limit, through, waiting = wrong[0]
        where = f"8 threads asking at once for one place each until refused, with max_waiting={limit}"
        assert through == limit, (
            f"{where}: yours let {through} through (and {len(wrong)} of {len(limits)} fresh admissions went "
            "wrong): the check (waiting < max_waiting) and the count must be one step under a lock, or two "
            "threads both take the last place"
        )
        raise AssertionError(
            f"{where}: your waiting is {waiting} after {limit} one-prompt adds got in: each is counted once, "
            "under the lock, even when threads count at the same time"
        )


# ---------------------------------------------------------------------------------------------- metrics

FAMILIES = [  # (prefix of the sample names, the rule), in the order they are compared
    ("nanolab_requests_total", "a finished request counts once under its first sample's finish reason ('abort' when it is None)"),
    ("nanolab_generation_tokens_total", "generation_tokens counts every sample's new tokens (delta_token_ids)"),
    ("nanolab_time_to_first_token_seconds", "TTFT observes now - arrival once per request, on its first output that carries any new token (last_token_time is None until then)"),
    ("nanolab_inter_token_latency_seconds", "ITL: on an output after the first with tokens, each sample with k > 0 new tokens gives k observations of (now - last_token_time) / k"),
    ("nanolab_e2e_request_latency_seconds", "a finished request observes now - arrival in e2e once, whether or not its last output has tokens"),
    ("nanolab_requests_running", "observe_stats: running is the snapshot's num_running"),
    ("nanolab_requests_waiting", "observe_stats: waiting is the snapshot's num_waiting"),
    ("nanolab_kv_blocks_total", "observe_stats: kv_total is the snapshot's kv_blocks_total"),
    ("nanolab_kv_blocks_free", "observe_stats: kv_free is the snapshot's kv_blocks_free"),
    ("nanolab_kv_blocks_cached", "observe_stats: kv_cached is the snapshot's kv_blocks_cached"),
    ("nanolab_kv_block_usage", "observe_stats: kv_usage is the fraction of the pool's blocks that are not free"),
]  # fmt: skip
NAMES = set(
    SetupMetricSet().values()
)  # every sample of the setup's MetricSet, as MetricSet.values names them


def sample_values(registry) -> dict[str, float]:
    """nanolab's samples named as `MetricSet.values` names them, for the samples a MetricSet has."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            if key in NAMES:
                out[key] = s.value
    return out


def compare_metrics(got, want: dict, where: str) -> None:
    got = expect(got, dict, f"{where}: MetricSet.values()")
    extra = sorted(set(got) - set(want))
    assert not extra, (
        f"{where}: your metrics have samples a MetricSet does not start with: {_short(extra, 200)} ({FAMILIES[0][1]})"
    )
    for prefix, rule in FAMILIES:
        for key in sorted(k for k in want if k.startswith(prefix)):
            a, b = got.get(key), want[key]
            ok = isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            assert ok, f"{where}: your {key} is {_short(a, 40)}: {rule}"


def random_requests(rng) -> list[tuple]:
    """A random mix of requests as the HTTP side sees them: per output, in time order, (request id, samples
    [(new tokens, finish reason)], finished, arrival, last_token_time, now). Some outputs carry no token at
    all (a request aborted before its first token, samples whose siblings still run), a sample may get
    several tokens at once, samples finish at different steps with different reasons, and the gaps range from
    under a millisecond to seconds."""
    calls, clock, live = [], 0.0, []
    for r in range(rng.randint(1, 6)):
        n = rng.randint(1, 3)
        live.append(
            dict(rid=f"r{r}", arrival=rng.uniform(0, 0.05), last=None, n=n, done={}, left=rng.randint(1, 6))
        )
    while live:
        clock += rng.choice([0.0003, 0.002, 0.004, 0.02, 0.07, 0.3, 0.8, 3.0, 12.0]) * rng.uniform(0.5, 1.5)
        req = rng.choice(live)
        req["left"] -= 1
        finished = req["left"] == 0
        aborted = finished and rng.random() < 0.15
        samples = []
        for s in range(req["n"]):
            if s in req["done"]:
                samples.append((0, req["done"][s]))
                continue
            k = 0 if aborted else rng.choice([0, 0, 1, 1, 1, 2, 3])
            reason = None
            if aborted:
                reason = None
            elif finished or rng.random() < 0.2:
                reason = rng.choice(["stop", "length", "timeout", "abort"])
                req["done"][s] = reason
            samples.append((k, reason))
        now = max(clock, req["arrival"])
        calls.append((req["rid"], samples, finished, req["arrival"], req["last"], now))
        if any(k for k, _ in samples):
            req["last"] = now
        if finished:
            live.remove(req)
    return calls


def fixed_requests() -> list[list[tuple]]:
    """Mixes that each show one rule, measured before the random ones."""
    return [
        [("a", [(0, None), (0, None)], False, 0.0, None, 0.2), ("a", [(1, None), (2, None)], False, 0.0, None, 0.5),
         ("a", [(1, "stop"), (3, "length")], True, 0.0, 0.5, 0.8)],
        [("b", [(1, None)] * 3, False, 1.0, None, 1.01), ("b", [(1, "stop")] * 3, True, 1.0, 1.01, 1.31)],
        [("c", [(0, None)], True, 2.0, None, 4.5)],
        [("d", [(2, None)], False, 0.0, None, 0.004), ("d", [(0, "timeout")], True, 0.0, 0.004, 0.9)],
        [("e", [(1, "length"), (1, "stop")], True, 0.0, None, 0.03)],
    ]  # fmt: skip


def output_text(rid, samples, finished) -> str:
    return f"RequestOutput({rid!r}, new tokens per sample {[k for k, _ in samples]}, finish reasons {[r for _, r in samples]}, finished={finished})"


def _outputs(make_sample, samples, totals: dict, rid: str) -> list:
    outs = []
    for i, (k, reason) in enumerate(samples):
        before = totals.get((rid, i), 0)
        totals[(rid, i)] = before + k
        outs.append(
            make_sample(
                i,
                "x" * (before + k),
                list(range(before + k)),
                reason,
                "x" * k,
                list(range(before, before + k)),
            )
        )
    return outs


@pytest.mark.points(1)
def test_observe_output_matches_nanolab(lab, rng):
    """observe_output writes what nanolab's ServerMetrics writes for the same outputs (fixed and random mixes of requests with n up to 3, outputs without tokens, several tokens at once, aborts, gaps from under a millisecond to seconds): tokens, TTFT once per request, ITL per sample and token, requests by finish reason, end-to-end latency, compared after every call"""
    mixes = fixed_requests() + [random_requests(rng) for _ in range(30)]
    for trial, calls in enumerate(mixes):
        try:
            mine = lab.MetricSet()
        except RemoteError as e:
            raise AssertionError(f"MetricSet() raised {_raised(e)}") from None
        ref, mine_totals, ref_totals = ServerMetrics(), {}, {}
        for rid, samples, finished, arrival, last, now in calls:
            where = (
                f"mix {trial}: observe_output(m, {output_text(rid, samples, finished)}, arrival={arrival:.6g}, "
                f"last_token_time={last if last is None else f'{last:.6g}'}, now={now:.6g})"
            )
            theirs = _outputs(NanolabCompletion, samples, ref_totals, rid)
            ref.observe_output(NanolabOutput(rid, None, [1, 2], theirs, finished, None), arrival, last, now)
            outs = _outputs(lab.CompletionOutput, samples, mine_totals, rid)
            try:
                lab.observe_output(mine, lab.RequestOutput(rid, [1, 2], outs, finished), arrival, last, now)
                got = mine.values()
            except RemoteError as e:
                raise AssertionError(f"{where}: yours raised {_raised(e)}") from None
            compare_metrics(got, sample_values(ref.registry), where)


def random_snapshot(rng) -> tuple[int, int, int, int, int]:
    """(num_running, num_waiting, kv_blocks_total, kv_blocks_free, kv_blocks_cached), some with the pool all
    free or all in use."""
    total = rng.choice([16, 64, 256, 1000])
    free = rng.choice([0, total, rng.randint(0, total)])
    return rng.randint(0, 64), rng.randint(0, 500), total, free, rng.randint(0, total - free)


@pytest.mark.points(1)
def test_observe_stats_sets_the_gauges(lab, rng):
    """observe_stats copies random engine snapshots into the gauges as nanolab's ServerMetrics does (running, waiting, the pool's blocks total, free and cached, and the fraction not free), each new snapshot replacing the last, and leaves the counters and histograms alone"""
    try:
        mine = lab.MetricSet()
    except RemoteError as e:
        raise AssertionError(f"MetricSet() raised {_raised(e)}") from None
    ref = ServerMetrics()
    snapshots = [(3, 7, 64, 16, 8), (0, 0, 256, 256, 0), (2, 1, 16, 0, 0)]
    snapshots += [random_snapshot(rng) for _ in range(40)]
    for snap in snapshots:
        running, waiting, total, free, cached = snap
        where = (
            f"observe_stats(m, EngineStats(num_running={running}, num_waiting={waiting}, kv_blocks_total={total}, "
            f"kv_blocks_free={free}, kv_blocks_cached={cached}))"
        )
        ref.observe_stats(
            SimpleNamespace(num_running=running, num_waiting=waiting, kv_blocks_total=total, kv_blocks_free=free,
                            kv_blocks_cached=cached, kv_block_usage=1 - free / total, mean_batch_size=1.0,
                            prefix_hit_rate=0.0)
        )  # fmt: skip
        try:
            lab.observe_stats(mine, lab.EngineStats(*snap))
            got = mine.values()
        except RemoteError as e:
            raise AssertionError(f"{where}: yours raised {_raised(e)}") from None
        compare_metrics(got, sample_values(ref.registry), where)
