"""`nanolab serve` under concurrent streaming clients vs offline `LLM.generate` on the same workload, same run.

Starts `nanolab serve` as a subprocess on 127.0.0.1 (a free port), then ``--clients`` concurrent clients
(default 32) stream ``--requests`` completions (default 128) through it: prompts cut from Python source
and sent as token ids, greedy, ``ignore_eos``, output lengths mixed, so every request generates exactly
the tokens it asks for. Measured at the client: request throughput, output tokens/s, time to first token
(TTFT) and inter-token latency (ITL: the gap between consecutive streamed chunks) at p50/p99.

The same requests then run through offline `LLM.generate` (all at once, in this process), and the script
prints the throughput ratio server / offline: what HTTP, JSON, server-sent events and arrival over time
cost on top of the engine. It also checks that every server output equals the offline output.

    python bench/bench_server.py                      # the bundled model
    python bench/bench_server.py --model DIR --clients 8 --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    text: str = ""
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    done: float = 0.0
    completion_tokens: int = 0


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def make_workload(
    tokenizer, n: int, seed: int, max_len: int, quick: bool
) -> tuple[list[list[int]], list[int]]:
    """n prompts (8..128 tokens) cut from Python source, and output lengths (16..96 tokens)."""
    import inspect
    import textwrap

    ids = tokenizer.encode(
        "".join(inspect.getsource(m) for m in (json, textwrap, random, statistics, argparse))
    )
    rng = random.Random(seed)
    hi_p, hi_o = (32, 24) if quick else (128, 96)
    prompts, lengths = [], []
    for _ in range(n):
        plen = rng.randint(min(8, max_len // 2), min(hi_p, max_len // 2))
        start = rng.randrange(0, len(ids) - plen)
        prompts.append(ids[start : start + plen])
        lengths.append(min(rng.randint(16, hi_o), max_len - plen))
    return prompts, lengths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {sample: value}."""
    text = httpx.get(f"{url}/metrics").text
    return {
        k: float(v) for k, v in (x.rsplit(" ", 1) for x in text.splitlines() if x and not x.startswith("#"))
    }


def start_server(args: argparse.Namespace, port: int, engine_in: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanolab.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs), "--engine-in", engine_in]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the server process
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully; the engine stops with it
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = Result(sent=time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                r.completion_tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    r.chunk_times.append(time.perf_counter())
                    r.text += c["text"]
    r.done = time.perf_counter()
    return r


async def run_clients(url: str, model: str, prompts, lengths, clients: int) -> tuple[float, list[Result]]:
    """``clients`` workers take requests from a shared queue until none is left; returns (wall s, results)."""
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        todo.put_nowait(i)
    results: list[Result | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not todo.empty():
                i = todo.get_nowait()
                results[i] = await one_request(client, model, prompts[i], lengths[i])

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        if len(prompts) > 2:
            print(f"client CPU time: {time.process_time() - cpu0:.2f} s over {wall:.2f} s")
        return wall, results  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (default 32)")
    p.add_argument("--requests", type=int, default=128, help="requests in the workload (default 128)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine option, for both server and offline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads, server and offline (default: torch's)"
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="give up on the server run after this many seconds"
    )
    p.add_argument("--quick", action="store_true", help="short prompts and outputs (a smoke test)")
    p.add_argument(
        "--engine-in",
        nargs="+",
        choices=["process", "thread"],
        default=["process", "thread"],
        help="serve with the engine in its own process, in a thread of the server, or both (default)",
    )
    args = p.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.requests <= 4096:
        p.error("--clients must be in [1, 256] and --requests in [1, 4096]")

    import torch

    from nanolab import LLM, SamplingParams
    from nanolab.model.loading import resolve_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    model_name = resolve_checkpoint(args.model).name
    prompts, lengths = make_workload(
        llm.tokenizer, args.requests, args.seed, llm.engine.config.max_model_len, args.quick
    )
    n_out = sum(lengths)
    print(
        f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {n_out} output tokens; "
        f"{args.clients} concurrent streaming clients; torch threads: {torch.get_num_threads()}"
    )

    served = {}
    for engine_in in args.engine_in:
        served[engine_in] = serve_workload(args, engine_in, model_name, prompts, lengths)
        if sum(r.completion_tokens for r in served[engine_in]["results"]) != n_out:
            raise SystemExit(f"the server (engine in a {engine_in}) generated a different number of tokens")

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    offline_wall = time.perf_counter() - t0
    offline_batch = llm.stats().mean_batch_size
    # The server never holds more than `clients` requests at once; offline with that cap separates
    # the cost of the lower concurrency from the cost of HTTP, JSON and streaming.
    capped = LLM(args.model, max_num_seqs=min(args.clients, args.max_num_seqs))
    t0 = time.perf_counter()
    capped.generate(prompts, params, use_tqdm=False)
    capped_wall = time.perf_counter() - t0

    rows = [(f"server, engine in a {k}", v["wall"], v["mean_batch"]) for k, v in served.items()]
    rows += [
        ("offline", offline_wall, offline_batch),
        (
            f"offline, {min(args.clients, args.max_num_seqs)} at a time",
            capped_wall,
            capped.stats().mean_batch_size,
        ),
    ]
    print(f"{'':32}{'req/s':>9}{'out tok/s':>11}{'wall s':>9}{'mean batch':>12}")
    for name, w, b in rows:
        print(f"{name:32}{len(prompts) / w:9.2f}{n_out / w:11.1f}{w:9.2f}{b:12.1f}")
    for engine_in, v in served.items():
        results, wall = v["results"], v["wall"]
        ttft = [r.chunk_times[0] - r.sent for r in results if r.chunk_times]
        itl = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        same = sum(r.text == o.outputs[0].text for r, o in zip(results, outs))
        print(f"-- the engine in a {engine_in}")
        print(
            f"throughput ratio server / offline: {offline_wall / wall:.2f}  (server / offline at the same "
            f"concurrency: {capped_wall / wall:.2f})"
        )
        print(
            f"server TTFT  p50 {percentile(ttft, 50) * 1e3:8.1f} ms   p99 {percentile(ttft, 99) * 1e3:8.1f} ms  "
            f"(mean {statistics.mean(ttft) * 1e3:.1f} ms at the client, {v['server_ttft'] * 1e3:.1f} ms "
            "inside the server)"
        )
        print(
            f"server ITL   p50 {percentile(itl, 50) * 1e3:8.1f} ms   p99 {percentile(itl, 99) * 1e3:8.1f} ms"
        )
        print(f"server engine busy (inside steps) {v['busy']:.0%} of the wall time")
        print(f"server outputs equal to offline greedy: {same}/{len(outs)}")


def serve_workload(args: argparse.Namespace, engine_in: str, model_name: str, prompts, lengths) -> dict:
    """Start a server with its engine in a process or a thread, run the clients, read its metrics."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, engine_in)
    try:
        wait_healthy(proc, url, timeout=120)
        asyncio.run(run_clients(url, model_name, prompts[:2], lengths[:2], 2))  # warm-up
        busy0 = scrape(url)["nanolab_engine_step_seconds_total"]
        wall, results = asyncio.run(
            asyncio.wait_for(run_clients(url, model_name, prompts, lengths, args.clients), args.timeout)
        )
        samples = scrape(url)
    finally:
        stop_server(proc)
    return {
        "wall": wall,
        "results": results,
        "mean_batch": samples["nanolab_mean_batch_size"],
        "server_ttft": samples["nanolab_time_to_first_token_seconds_sum"]
        / samples["nanolab_time_to_first_token_seconds_count"],
        "busy": (samples["nanolab_engine_step_seconds_total"] - busy0) / wall,
    }


if __name__ == "__main__":
    main()
