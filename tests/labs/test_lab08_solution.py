"""Lab 8's solution against nanolab: signatures, the setup's mirrors of the reference types, the docstrings'
examples, the graded cells run on their own (as the grader runs them), and the solution against nanolab's
references on the hidden tests' random inputs, in this process."""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import json
import math
import random
from pathlib import Path

from helpers.grading_utils import solution_namespace
from helpers.notebook_utils import parameters

from labkit import lab08 as setup
from nanolab.engine import outputs as nanolab_outputs
from nanolab.engine.core import EngineStepError
from nanolab.model.sampling import SamplingParams
from nanolab.serving import async_engine, chat_protocol, metrics, openai_protocol

ROOT = Path(__file__).resolve().parents[2]
LAB08 = "lab08_serving.ipynb"


def hidden_tests(config):
    """Lab 8's hidden test module, for its random inputs and its reference drivers (not collected here; its
    markers, which the grader's plugin registers, are registered here for the import)."""
    for marker in ("points(n): what a hidden test is worth", "visibility(v): its Gradescope visibility"):
        config.addinivalue_line("markers", marker)
    spec = importlib.util.spec_from_file_location(
        "lab08_hidden", ROOT / "autograder" / "tests" / "test_lab08.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lab08_learner_code_has_the_reference_signatures():
    """The graded names take the reference's parameters; the loop's methods are nanolab's EngineLoop's."""
    namespace = solution_namespace(LAB08)
    assert parameters(namespace["parse_completion_request"]) == parameters(
        openai_protocol.parse_completion_request
    )
    assert parameters(namespace["parse_chat_request"]) == parameters(chat_protocol.parse_chat_request)
    assert parameters(namespace["histogram_quantile"]) == parameters(metrics.histogram_quantile)
    for method in ("__init__", "admit", "on_round"):
        assert parameters(getattr(namespace["Admission"], method)) == parameters(
            getattr(async_engine.Admission, method)
        ), method
    # the metric functions take the metric set where nanolab's methods take self
    for name in ("observe_output", "observe_stats"):
        mine = [p for p, _ in parameters(namespace[name])][1:]
        assert mine == [p for p, _ in parameters(getattr(metrics.ServerMetrics, name))][1:], name
    loop = namespace["EngineLoop"]
    for method in ("__init__", "add", "expire", "step", "route", "take_round"):
        assert parameters(getattr(loop, method)) == parameters(getattr(async_engine.EngineLoop, method)), (
            method
        )
    base = namespace["LoopBase"]  # the setup cell's
    assert issubclass(loop, base)
    for method in ("run", "handle", "stop_all"):  # given by the setup: the learner's class inherits them
        assert getattr(loop, method) is getattr(base, method), method
        assert parameters(getattr(base, method)) == parameters(getattr(async_engine.EngineLoop, method))


def test_lab08_setup_mirrors_the_reference_types():
    """The setup's types (`labkit.lab08`, the setup cell's text) have nanolab's names, fields and defaults, as
    far as the lab goes: the hidden tests compare them with nanolab's, and the notebook converts between them."""
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for f in dataclasses.fields(setup.SamplingParams):
        assert f.name in defaults and f.default == defaults[f.name], f.name
    request = {f.name: f.default for f in dataclasses.fields(openai_protocol.CompletionRequest)}
    for f in dataclasses.fields(setup.CompletionRequest):
        assert f.name in request and (f.default == request[f.name] or f.default is dataclasses.MISSING), (
            f.name
        )
    assert (
        names(setup.CompletionOutput)
        == names(nanolab_outputs.CompletionOutput)[: len(names(setup.CompletionOutput))]
    )
    assert set(names(setup.RequestOutput)) <= set(names(nanolab_outputs.RequestOutput))
    assert names(setup.AddCommand) == names(async_engine.AddCommand)
    assert names(setup.AbortCommand) == names(async_engine.AbortCommand)
    assert names(setup.Round) == names(async_engine.Round)
    assert setup.STOP == async_engine.STOP
    assert setup.InvalidRequest.__name__ == openai_protocol.InvalidRequest.__name__
    assert issubclass(setup.InvalidRequest, ValueError) and issubclass(
        openai_protocol.InvalidRequest, ValueError
    )
    error = setup.InvalidRequest("bad top_p", "top_p")
    assert (str(error), error.message, error.param) == ("bad top_p", "bad top_p", "top_p")
    assert setup.EngineStepError.__name__ == EngineStepError.__name__
    assert [name for name, _ in parameters(setup.EngineStepError)] == [
        name for name, _ in parameters(EngineStepError)
    ]
    for data in ({"a": [1, None, "é"]}, "[DONE]"):
        assert setup.sse(data) == openai_protocol.sse(data)
    chat = {f.name for f in dataclasses.fields(chat_protocol.ChatRequest)}
    assert set(names(setup.ChatRequest)) <= chat
    assert setup.ServerOverloaded.__name__ == async_engine.ServerOverloaded.__name__
    assert (
        setup.ServerOverloaded("full", 3).retry_after == async_engine.ServerOverloaded("full", 3).retry_after
    )
    # the setup's MetricSet: nanolab's names, kinds, labels and buckets for the metrics it holds
    ours, theirs = setup.MetricSet(), metrics.ServerMetrics()
    assert setup.LATENCY_BUCKETS == metrics.LATENCY_BUCKETS
    for attribute, metric in vars(ours).items():
        if attribute == "registry":
            continue
        reference = getattr(theirs, attribute)
        assert type(metric) is type(reference), attribute
        assert metric._name == reference._name and metric._labelnames == reference._labelnames, attribute

    def key(sample) -> str:  # as MetricSet.values names a sample
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
        return f"{sample.name}{{{labels}}}" if labels else sample.name

    assert set(ours.values()) <= {key(s) for family in theirs.registry.collect() for s in family.samples}
    stats_fields = set(names(setup.EngineStats))
    from nanolab.engine.stats import EngineStats as NanolabStats

    assert stats_fields <= set(names(NanolabStats))


def test_lab08_graded_cells_run_without_the_notebook_imports():
    """The grader runs the setup cell and the graded cells only: what those cells use must come from them (the
    notebook's imports cell, which imports math, is not run)."""
    namespace = solution_namespace(LAB08)
    assert namespace["histogram_quantile"](0.5, [(0.1, 2), (0.2, 6), (math.inf, 6)]) == 0.125
    with_top_p = namespace["parse_completion_request"](
        {"prompt": "x", "top_p": 0.5, "temperature": 0}, "tinypy"
    )
    assert with_top_p.params.top_p == 0.5
    admission = namespace["Admission"](1)  # its lock comes from the setup's threading import
    admission.admit(1)
    assert admission.waiting == 1
    held = namespace["MetricSet"]()
    output = namespace["RequestOutput"](
        "r", [1], [namespace["CompletionOutput"](0, "a", [1], "stop", "a", [1])], True
    )
    namespace["observe_output"](held, output, 0.0, None, 0.25)
    assert held.values()['nanolab_requests_total{status="stop"}'] == 1


def test_lab08_docstring_examples_run_on_the_solution():
    namespace = solution_namespace(LAB08)
    # the solution's module is not __main__, so an exception's name comes with it: ignore the module path
    finder, runner = (
        doctest.DocTestFinder(),
        doctest.DocTestRunner(optionflags=doctest.IGNORE_EXCEPTION_DETAIL),
    )
    names = ("parse_completion_request", "parse_chat_request", "completion_events", "histogram_quantile")
    tests = [t for name in names for t in finder.find(namespace[name], name, globs=namespace)]
    assert sum(len(t.examples) for t in tests) >= 6
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab08_solution_agrees_with_nanolab_on_the_hidden_tests_inputs(pytestconfig):
    """The hidden tests' random bodies, streams, sessions and histograms, run on the solution in this process
    (no sandbox), agree with nanolab's references: the hidden tests can be passed."""
    hidden, namespace = hidden_tests(pytestconfig), solution_namespace(LAB08)
    rng = random.Random(8)
    parse = namespace["parse_completion_request"]
    for body, field in [(hidden.good_body(rng), None) for _ in range(200)] + hidden.bad_bodies(rng):
        want = hidden.reference_parse(body)
        try:
            r = parse(body, hidden.MODEL)
        except namespace["InvalidRequest"] as e:
            assert want == ("refused", e.param) == ("refused", field), body
            continue
        p = r.params
        got = dict(prompts=r.prompts, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, n=p.n,
                   stop=p.stop, seed=p.seed, stream=r.stream, include_usage=r.include_usage,
                   ignored=list(r.ignored), model=r.model)  # fmt: skip
        assert ("ok", got) == want, body
    for _ in range(200):
        items, num_prompts, n = hidden.random_stream(rng)
        usage = rng.random() < 0.5
        built = []
        for item in items:
            if item[0] == "error":
                built.append((0, namespace["EngineStepError"](item[1])))
            else:
                _, p, rid, prompt, samples, finished = item
                outs = [namespace["CompletionOutput"](*s) for s in samples]
                built.append((p, namespace["RequestOutput"](rid, prompt, outs, finished)))
        mine = namespace["completion_events"](built, "cmpl-1", "tinypy", 7, num_prompts, n, usage)
        theirs = hidden.reference_events(items, "cmpl-1", "tinypy", 7, num_prompts, n, usage)
        assert [json.loads(e[6:]) if "[DONE]" not in e else e for e in mine] == [
            json.loads(e[6:]) if "[DONE]" not in e else e for e in theirs
        ]
    seen = {"refused": 0, "timeout": 0, "failed": 0, "abort": 0}
    for _ in range(100):
        ops = hidden.random_ops(rng, rng.randint(20, 45))
        want = hidden.reference_session(ops)
        assert play_solution(namespace, ops) == [
            {k: v for k, v in r.items() if k != "unfinished"} for r in want
        ]
        for r in want:
            seen["refused"] += len(r["refused"])
            seen["failed"] += len(r["failed"])
            seen["timeout"] += sum(o[2] == "timeout" for o in r["outputs"])
            seen["abort"] += sum(o[2] == "abort" for o in r["outputs"])
    assert min(seen.values()) > 0, seen  # the sessions cover every way a request ends
    for _ in range(500):
        buckets = hidden.random_histogram(rng)
        q = rng.choice([0.0, 1.0, rng.random()])
        assert hidden.quantile_close(
            namespace["histogram_quantile"](q, buckets), metrics.histogram_quantile(q, buckets)
        )


def play_solution(namespace: dict, ops: list) -> list[dict]:
    """The hidden tests' session, played on the solution's EngineLoop (and its setup's types) in this process."""
    ns = namespace
    engine = ns["ToyEngine"](**ops[0][1])
    loop = ns["EngineLoop"](engine)
    rounds = []
    for op in ops[1:]:
        if op[0] == "add":
            _, add_id, ids, prompts, max_tokens, deadline = op
            params = [ns["SamplingParams"](max_tokens=m) for m in max_tokens]
            loop.handle(ns["AddCommand"](add_id, list(ids), [list(p) for p in prompts], params, 0, deadline))
        elif op[0] == "direct":
            engine.add_requests([op[2]], [ns["SamplingParams"](max_tokens=op[3])], 0, [op[1]])
        elif op[0] == "abort":
            loop.handle(ns["AbortCommand"](list(op[1])))
        elif op[0] == "expire":
            loop.expire(op[1])
        elif op[0] == "step":
            if engine.has_unfinished():
                loop.step()
        else:
            r = loop.take_round()
            rounds.append(
                dict(
                    accepted=r.accepted,
                    refused=r.refused,
                    outputs=[
                        (o.request_id, o.outputs[0].delta_token_ids, o.outputs[0].finish_reason, o.finished)
                        for o in r.outputs
                    ],
                    failed=r.failed,
                    step_errors=r.step_errors,
                    handled=r.handled,
                    waiting=r.stats.num_waiting,
                    live=sorted(loop.live),
                    deadlines=sorted(loop.deadlines.items()),
                )
            )
    return rounds
