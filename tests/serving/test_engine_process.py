"""Tests of the engine process's life cycle: it starts with the server, stops with it, and neither side
outlives the other. (What the server answers with its engine in a process is tested by the server tests,
which run on both layouts; that Ctrl-C stops `nanolab serve` and its engine process, and that a shutdown
aborts running requests, by test_server.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from helpers.engine_faults import Faults, engine_noting_threads, faulty_engine  # noqa: E402
from helpers.live_server import alive, engine_children, run_app, wait_healthy  # noqa: E402

from nanolab import SamplingParams  # noqa: E402
from nanolab.engine.config import EngineConfig  # noqa: E402
from nanolab.model.config import ModelConfig  # noqa: E402
from nanolab.model.loading import load_tokenizer, save_model  # noqa: E402
from nanolab.model.transformer import Transformer  # noqa: E402
from nanolab.serving.engine_process import EngineProcessError, ProcessAsyncEngine  # noqa: E402
from nanolab.serving.server import build_app, engine_process_threads  # noqa: E402
from nanolab.text.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and sends signals")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = inspect.getsource(json) + inspect.getsource(textwrap)
    tokenizer = Tokenizer.train(text, 300, special_tokens=["<|endoftext|>"])
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_model=32,
        d_ff=64,
        max_seq_len=128,
    )
    torch.manual_seed(0)
    return save_model(Transformer(config), tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer)


def engine(
    checkpoint: Path, folder: Path, config: EngineConfig | None = None, **kwargs
) -> ProcessAsyncEngine:
    factory = functools.partial(faulty_engine, str(checkpoint), str(folder), config)
    return ProcessAsyncEngine(factory, load_tokenizer(str(checkpoint)), **kwargs)


def wait_until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_engine_that_cannot_be_built_fails_start_with_its_traceback(tmp_path: Path) -> None:
    aengine = ProcessAsyncEngine(functools.partial(faulty_engine, str(tmp_path / "no-such-checkpoint"), "."))
    with pytest.raises(EngineProcessError, match="could not build its engine") as info:
        aengine.start()
    assert "Traceback" in str(info.value) and "no-such-checkpoint" in str(info.value)
    wait_until(lambda: aengine.process.exitcode is not None, "the engine process to end")
    assert not aengine.is_running


@pytest.mark.parametrize("given", [None, 2])
def test_the_engine_process_runs_torch_with_the_threads_asked_for_or_this_process_s(
    checkpoint: Path, tmp_path: Path, given: int | None
) -> None:
    """A fresh interpreter would take one torch thread per core; the engine process takes ``torch_threads``,
    or as many as the process that started it uses."""
    note = tmp_path / "threads"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        aengine = ProcessAsyncEngine(
            functools.partial(engine_noting_threads, str(checkpoint), str(note)), torch_threads=given
        )
        aengine.start()
        aengine.shutdown()
    finally:
        torch.set_num_threads(before)
    assert note.read_text() == str(given or 1)


def test_nanolab_serve_leaves_the_front_end_a_core_unless_told_otherwise(monkeypatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for cores, expected in ((1, 1), (2, 1), (8, 7)):
            torch.set_num_threads(cores)
            assert engine_process_threads() == expected
            assert engine_process_threads(3) == 3  # --engine-threads
        monkeypatch.setenv("OMP_NUM_THREADS", "8")  # taken as it is
        assert engine_process_threads() == 8
    finally:
        torch.set_num_threads(before)


def test_nanolab_serve_says_how_many_threads_its_engine_process_runs(checkpoint: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "nanolab.cli", "serve", "--model", str(checkpoint), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONUNBUFFERED": "1"}
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    expected = max(1, int(fresh.stdout) - 1)
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], stderr=subprocess.PIPE, env=env, text=True)
    try:  # printed once the engine process is up, before listening, after any notes on the checkpoint
        lines = [proc.stderr.readline()]
        while "serving" not in lines[-1] and lines[-1] and len(lines) < 5:
            lines.append(proc.stderr.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    word = "thread" if expected == 1 else "threads"
    assert any(f"the engine in its own process ({expected} torch {word})" in line for line in lines), lines


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_torch_threads_is_a_value_error(value) -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        ProcessAsyncEngine(lambda: None, torch_threads=value)


def test_deadlines_and_back_pressure_hold_across_the_process_boundary(
    checkpoint: Path, tmp_path: Path
) -> None:
    """One running slot: a second request waits; past its deadline it ends with "timeout" and no text;
    a third call beyond max_waiting=1 is refused at once."""
    from nanolab.serving.async_engine import ServerOverloaded

    faults = Faults(tmp_path)
    aengine = engine(checkpoint, tmp_path, EngineConfig(max_num_seqs=1), max_waiting=1)
    aengine.start()
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main():
        with faults.slow():
            running = await aengine.add("a", ["import os"], [long])
            await running.queue.get()  # admitted: it has a token
            waiting = await aengine.add("b", ["def f"], [long], timeout=0.3)
            with pytest.raises(ServerOverloaded):
                await aengine.add("c", ["x"], [long])
            while not (late := (await waiting.queue.get())[1]).finished:
                pass
            aengine.abort(running.request_ids)
            while not (first := (await running.queue.get())[1]).finished:
                pass
        return late, first

    try:
        late, first = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert late.outputs[0].finish_reason == "timeout" and late.outputs[0].token_ids == []
    assert first.outputs[0].finish_reason == "abort"


def test_an_engine_process_that_dies_fails_its_requests_and_the_server_says_so(
    checkpoint: Path, tmp_path: Path
) -> None:
    faults = Faults(tmp_path)
    deaths = []
    aengine = engine(checkpoint, tmp_path, on_engine_death=lambda: deaths.append(True))
    body = {"prompt": "while True:", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with run_app(build_app(aengine, "tiny")) as url, httpx.Client(base_url=url, timeout=30) as http:
        with faults.slow(), http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is running
            os.kill(aengine.process.pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "engine process died" in rest and "data: [DONE]" in rest
        assert deaths == [True]
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        m = aengine.metrics.registry.get_sample_value
        assert m("nanolab_requests_total", {"status": "error"}) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(checkpoint: Path) -> tuple[subprocess.Popen, httpx.Client, int]:
    """``nanolab serve`` in a process of its own, healthy; returns it, a client and its engine's pid."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanolab.cli", "serve", "--model", str(checkpoint), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_healthy(http, 90, proc)
        [child] = engine_children(proc.pid)
    except BaseException:
        proc.kill()
        proc.wait()
        http.close()
        raise
    return proc, http, child


def test_an_engine_process_outlives_no_killed_server(checkpoint: Path) -> None:
    proc, http, child = start_serve(checkpoint)
    http.close()
    proc.kill()  # SIGKILL: the front end cannot say goodbye
    proc.wait()
    wait_until(lambda: not alive(child), "the orphaned engine process to exit", timeout=10)


def test_nanolab_serve_exits_with_1_when_its_engine_process_dies(checkpoint: Path) -> None:
    proc, http, child = start_serve(checkpoint)
    http.close()
    os.kill(child, signal.SIGKILL)
    try:
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert code == 1, err
    assert "engine process died" in err


def test_outputs_cross_as_deltas_and_arrive_equal_to_the_engine_s(checkpoint: Path) -> None:
    """A request's later outputs cross the socket as what changed (`OutputCodec`), and the front end
    rebuilds each one equal to the engine's: with a stop string that cuts text back (its first half was
    streamed, held back, in an earlier output), parallel samples whose outputs name only the samples that
    changed, log-probabilities of the prompt and the output, an abort of a request that has streamed, and
    preemptions in a pool too small for the batch. And a step's message no longer grows with the prompts:
    late in the run it is a fraction of what the outputs pickled whole take."""
    from nanolab.engine.engine import Engine
    from nanolab.model.loading import load_model
    from nanolab.serving.engine_process import OutputCodec

    tokenizer = load_tokenizer(str(checkpoint))
    source = inspect.getsource(json)
    prompts = [source[i * 97 : i * 97 + 40 + 5 * i] for i in range(10)]
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, seed=1, stop=["e", "\n"]),
        SamplingParams(max_tokens=30, temperature=1.0, seed=2, n=3, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, prompt_logprobs=1, logprobs=0),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop=["ons", "ret"], n=2),
    ] * 2

    def run(params: list[SamplingParams], on_step) -> None:
        engine = Engine(
            load_model(str(checkpoint)),
            tokenizer,
            EngineConfig(block_size=4, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=32),
        )
        engine.add_requests(prompts, params, request_ids=[f"r{i}" for i in range(len(prompts))])
        steps = 0
        while engine.has_unfinished():
            steps += 1
            on_step(engine, steps, engine.step())
        assert engine.stats().preemptions > 0, "the pool was meant to be too small for the whole batch"

    # r0's sampled tokens (seeded), to find a stop string across two of them: the text that streams the
    # first half (held back) is cut back when the second arrives. Up to the stop, r0 runs the same in both.
    finals = {}
    run(params, lambda engine, step, produced: finals.update({o.request_id: o for o in produced}))
    ids = finals["r0"].outputs[0].token_ids
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    stop = next(
        a[-1] + b[len(a)]
        for a, b in zip(texts[3:], texts[4:])
        if a and b.startswith(a) and len(b) > len(a) and texts[-1].find(a[-1] + b[len(a)]) == len(a) - 1
    )
    params[0] = dataclasses.replace(params[0], stop=[stop])

    sender, receiver = OutputCodec(), OutputCodec()
    seen = dict(
        outputs=0, deltas=0, late_whole=0, late_wire=0, cut_back=0, stopped=0, aborted=None, abort_delta=0
    )
    texts_so_far: dict[tuple[str, int], str] = {}

    def cross(engine, step: int, produced: list) -> None:
        if step == 15:  # a request that has streamed (the codec holds its last output) is aborted
            victim = next(rid for rid in sorted(sender.last) if rid != "r0")
            produced.append(engine.abort(victim))
            seen["aborted"] = victim
        produced = [o for o in produced if o is not None]
        wire = [sender.encode(o) for o in produced]
        seen["deltas"] += sum(isinstance(w, tuple) for w in wire)
        received = pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
        for original, w in zip(produced, received, strict=True):
            assert receiver.decode(w) == original
            seen["outputs"] += 1
            if original.request_id == seen["aborted"] and original.finished:  # its last output, a delta
                assert isinstance(w, tuple) and original.outputs[0].finish_reason == "abort"
                seen["abort_delta"] += 1
            for c in original.outputs:
                before = texts_so_far.get((original.request_id, c.index), "")
                seen["cut_back"] += not c.text.startswith(before)
                seen["stopped"] += c.finish_reason == "stop"
                texts_so_far[original.request_id, c.index] = c.text
        if step > 20:
            seen["late_wire"] += len(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
            seen["late_whole"] += len(pickle.dumps(produced, protocol=pickle.HIGHEST_PROTOCOL))

    run(params, cross)
    assert texts_so_far["r0", 0] == texts[-1][: texts[-1].find(stop)], "r0 stops at its stop string"
    assert seen["cut_back"] >= 1 and seen["stopped"] >= 1 and seen["abort_delta"] == 1, seen
    assert seen["outputs"] > 100 and seen["deltas"] > seen["outputs"] - 3 * len(prompts), seen
    assert not sender.last and not receiver.last, "finished requests are forgotten on both sides"
    assert seen["late_wire"] < seen["late_whole"] / 3, seen


def test_a_failed_request_is_forgotten_on_both_sides_and_an_unreadable_output_fails_only_its_own() -> None:
    from nanolab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from nanolab.serving.async_engine import Round
    from nanolab.serving.engine_process import OutputCodec

    def output(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
        sample = CompletionOutput(0, None, tokens, None, "", tokens[-1:])
        return RequestOutput(
            rid, None, [1, 2], [sample], finished, RequestMetrics(0.0, None, None, 2, 1, 0, 0)
        )

    sender, receiver = OutputCodec(), OutputCodec()
    for rnd in (Round(outputs=[output("a", [5]), output("b", [6])]), Round(outputs=[output("a", [5, 7])])):
        receiver.decode_round(sender.encode_round(rnd))
    assert set(sender.last) == set(receiver.last) == {"a", "b"}
    failed = Round(failed=[("a", "the step failed")])
    assert receiver.decode_round(sender.encode_round(failed)) == []
    assert set(sender.last) == set(receiver.last) == {"b"}

    # "b" is unknown to a fresh receiver: its delta cannot be read, so "b" fails (and is to be aborted),
    # its later outputs are dropped until its last, and "c" in the same rounds arrives as usual
    stranger = OutputCodec()
    rnd = sender.encode_round(Round(outputs=[output("b", [6, 8]), output("c", [9])]))
    assert stranger.decode_round(rnd) == ["b"]
    assert [o.request_id for o in rnd.outputs] == ["c"] and rnd.failed[0][0] == "b"
    rnd = sender.encode_round(Round(outputs=[output("b", [6, 8, 9], finished=True), output("c", [9, 1])]))
    assert stranger.decode_round(rnd) == [] and [o.request_id for o in rnd.outputs] == ["c"]
    assert not stranger.dropped and set(stranger.last) == {"c"}
