"""`nanolab serve` under concurrent streaming clients vs offline `LLM.generate` on the same workload, same run.

Starts `nanolab serve` as a subprocess on 127.0.0.1 (a free port), then ``--clients`` concurrent clients
(default 32) stream ``--requests`` completions (default 128) through it: prompts cut from Python source
and sent as token ids, greedy, ``ignore_eos``, output lengths mixed, so every request generates exactly
the tokens it asks for. Measured at the client: request throughput, output tokens/s, time to first token
(TTFT) and inter-token latency (ITL: the gap between consecutive streamed chunks) at p50/p99. The
clients are lean (`Connection`: HTTP/1.1 on asyncio's streams), because on a small machine they share
the cores with the server they measure; ``--client httpx`` uses httpx instead.

The same requests then run through offline `LLM.generate` (all at once, in this process; then at most
``--clients`` at a time, the server's concurrency; then that again with the engine process's torch
threads), and the script prints the throughput ratios server / offline: what HTTP, JSON, server-sent
events and arrival over time cost on top of the engine. Every row runs once per turn (``--repeat``,
default 3), so each ratio compares runs made moments apart; the script prints the median and range. It
also prints the CPU time per output token of the HTTP process, the engine process and the client, and
checks that every server output equals the offline output.

    python bench/bench_server.py                      # the bundled model
    python bench/bench_server.py --model DIR --clients 8 --requests 32
    python bench/bench_server.py --prompt-tokens 256 400   # long prompts
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import psutil


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
    tokenizer, n: int, seed: int, max_len: int, quick: bool, prompt_range: tuple[int, int] = (8, 128)
) -> tuple[list[list[int]], list[int]]:
    """n prompts (``prompt_range`` tokens, 8..128 by default) cut from Python source, and output lengths
    (16..96 tokens); a prompt leaves room for 16 output tokens at least."""
    import inspect
    import textwrap

    ids = tokenizer.encode(
        "".join(inspect.getsource(m) for m in (json, textwrap, random, statistics, argparse))
    )
    rng = random.Random(seed)
    lo_p, hi_p = (8, 32) if quick else prompt_range
    hi_o = 24 if quick else 96
    prompts, lengths = [], []
    for _ in range(n):
        plen = rng.randint(min(lo_p, max_len - 16), min(hi_p, max_len - 16))
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
    if engine_in == "process":
        cmd += ["--engine-threads", str(args.engine_threads)]
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


class Connection:
    """One kept-alive HTTP/1.1 connection that streams server-sent events, on asyncio's streams.

    The load generator shares the machine's cores with the server it measures, so it does as little as
    it can per event: no HTTP library, the response read in raw chunks, each event split off by its blank
    line (`httpx`, ``--client httpx``, spends several times its CPU time per event)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def post_events(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """POST ``body`` as JSON and yield the payload of each ``data:`` event of the chunked response
        (events end with a blank line, ``\\n\\n``, as nanolab's server writes them)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        reader = self.reader
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        if "chunked" not in headers.get("transfer-encoding", ""):  # an error: a JSON body, no stream
            size = int(headers.get("content-length", 0))
            body = await reader.readexactly(size) if size else b""
            await self.close()  # this connection is not used again
            raise RuntimeError(f"{head[0]}: {body.decode(errors='replace')}")
        if status != 200:
            body = b"".join([chunk async for chunk in self._chunks()])
            await self.close()
            raise RuntimeError(f"HTTP {status}: {body.decode(errors='replace')}")
        pending = b""
        async for chunk in self._chunks():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The chunks of a chunked body, to its last (empty) one and the blank line after it."""
        reader = self.reader
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any, then the end
                    pass
                return
            yield (await reader.readexactly(size + 2))[:-2]  # the chunk without its CRLF


async def one_request(conn: Connection, model: str, prompt: list[int], max_tokens: int) -> Result:
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
    if isinstance(conn, Connection):
        async for data in conn.post_events("/v1/completions", body):
            if data != b"[DONE]":
                read_chunk(r, json.loads(data))
    else:
        async with conn.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    read_chunk(r, json.loads(line[6:]))
    r.done = time.perf_counter()
    return r


def read_chunk(r: Result, chunk: dict) -> None:
    if "error" in chunk:
        raise RuntimeError(chunk["error"]["message"])
    if chunk.get("usage"):
        r.completion_tokens = chunk["usage"]["completion_tokens"]
    for c in chunk["choices"]:
        if c["text"]:
            r.chunk_times.append(time.perf_counter())
            r.text += c["text"]


async def run_clients(
    url: str, model: str, prompts, lengths, clients: int, kind: str = "asyncio"
) -> tuple[float, list[Result]]:
    """``clients`` workers take requests from a shared queue until none is left; returns (wall s, results).
    ``kind``: each worker's own `Connection` ("asyncio"), or one shared `httpx.AsyncClient` ("httpx")."""
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        todo.put_nowait(i)
    results: list[Result | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            conn = Connection(host, int(port)) if kind == "asyncio" else client
            try:
                while not todo.empty():
                    i = todo.get_nowait()
                    results[i] = await one_request(conn, model, prompts[i], lengths[i])
            finally:
                if isinstance(conn, Connection):
                    await conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
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
    p.add_argument("--quick", action="store_true", help="short prompts and outputs, one turn (a smoke test)")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        nargs=2,
        default=(8, 128),
        metavar=("MIN", "MAX"),
        help="each prompt's length is drawn from MIN..MAX tokens (default 8 128)",
    )
    p.add_argument(
        "--engine-in",
        nargs="+",
        choices=["process", "thread"],
        default=["process", "thread"],
        help="serve with the engine in its own process, in a thread of the server, or both (default)",
    )
    p.add_argument(
        "--client",
        choices=["asyncio", "httpx"],
        default="asyncio",
        help="the load generator's HTTP client: a lean one on asyncio's streams (default), or httpx",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the server's engine process (default: what `nanolab serve` takes, one fewer "
        "than the cores); offline also runs once per turn with this many",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="turns of every row, for the median and range (default 3)"
    )
    args = p.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.requests <= 4096:
        p.error("--clients must be in [1, 256] and --requests in [1, 4096]")
    if not 1 <= args.repeat <= 20:
        p.error("--repeat must be in [1, 20]")
    if not 1 <= args.prompt_tokens[0] <= args.prompt_tokens[1]:
        p.error("--prompt-tokens takes MIN <= MAX, both >= 1")
    if args.quick:
        args.repeat = 1

    import torch

    from nanolab import LLM, SamplingParams
    from nanolab.model.loading import resolve_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    from nanolab.serving.server import engine_process_threads

    args.engine_threads = engine_process_threads(args.engine_threads or args.threads)
    if args.engine_threads < 1:
        p.error("--engine-threads must be >= 1")

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    model_name = resolve_checkpoint(args.model).name
    prompts, lengths = make_workload(
        llm.tokenizer,
        args.requests,
        args.seed,
        llm.engine.config.max_model_len,
        args.quick,
        tuple(args.prompt_tokens),
    )
    n_out = sum(lengths)
    print(
        f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {n_out} output tokens; "
        f"{args.clients} concurrent streaming clients; torch threads: {torch.get_num_threads()}"
    )

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    # The server never holds more than `clients` requests at once; offline with that cap separates
    # the cost of the lower concurrency from the cost of HTTP, JSON and streaming.
    cap = min(args.clients, args.max_num_seqs)
    capped = LLM(args.model, max_num_seqs=cap)
    capped.generate(prompts[:2], params[:2], use_tqdm=False)

    servers = {k: Server(args, k, model_name) for k in args.engine_in}
    runs: dict[str, list[dict]] = {k: [] for k in args.engine_in}
    offline_walls, capped_walls, engine_walls = [], [], []
    threads = torch.get_num_threads()
    engine_threads = f"{args.engine_threads} torch thread{'s' if args.engine_threads > 1 else ''}"
    try:
        for server in servers.values():
            server.start(prompts, lengths)
        # Each turn runs every row once, back to back, so a ratio compares runs measured moments apart:
        # on a shared machine the speed of the whole machine drifts between turns.
        for turn in range(args.repeat):
            for engine_in, server in servers.items():
                run = server.run(prompts, lengths)
                if sum(r.completion_tokens for r in run["results"]) != n_out:
                    raise SystemExit(
                        f"the server (engine in a {engine_in}) generated a different number of tokens"
                    )
                runs[engine_in].append(run)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            offline_walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            capped.generate(prompts, params, use_tqdm=False)
            capped_walls.append(time.perf_counter() - t0)
            if "process" in runs and args.engine_threads == threads:
                engine_walls.append(capped_walls[-1])  # the capped row already ran on that many threads
            elif "process" in runs:
                # The engine process's thread count: what the server's engine could reach with no front end.
                torch.set_num_threads(args.engine_threads)
                t0 = time.perf_counter()
                capped.generate(prompts, params, use_tqdm=False)
                engine_walls.append(time.perf_counter() - t0)
                torch.set_num_threads(threads)
            if args.repeat > 1:
                line = "  ".join(
                    f"{k} {offline_walls[-1] / v[-1]['wall']:.2f} ({capped_walls[-1] / v[-1]['wall']:.2f})"
                    for k, v in runs.items()
                )
                print(f"turn {turn + 1}/{args.repeat}, server / offline (same concurrency): {line}")
    finally:
        for server in servers.values():
            server.stop()

    rows = [
        (f"server, engine in a {k}", [r["wall"] for r in v], total(v, "batch_sum") / total(v, "steps"))
        for k, v in runs.items()
    ]
    rows += [
        ("offline", offline_walls, llm.stats().mean_batch_size),
        (f"offline, {cap} at a time", capped_walls, capped.stats().mean_batch_size),
    ]
    if engine_walls and args.engine_threads != threads:
        rows.append(
            (
                f"  same, {engine_threads}",
                engine_walls,
                capped.stats().mean_batch_size,
            )
        )
    print(f"{'':32}{'req/s':>9}{'out tok/s':>11}{'wall s':>9}{'mean batch':>12}  (medians of {args.repeat})")
    for name, walls, b in rows:
        w = statistics.median(walls)
        print(f"{name:32}{len(prompts) / w:9.2f}{n_out / w:11.1f}{w:9.2f}{b:12.1f}")
    for engine_in, v in runs.items():
        ratios = [o / r["wall"] for o, r in zip(offline_walls, v)]
        same = [c / r["wall"] for c, r in zip(capped_walls, v)]
        results = [x for r in v for x in r["results"]]
        ttft = [r.chunk_times[0] - r.sent for r in results if r.chunk_times]
        itl = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        equal = sum(r.text == o.outputs[0].text for run in v for r, o in zip(run["results"], outs))
        print(f"-- the engine in a {engine_in}")
        print(
            f"throughput ratio server / offline: {spread(ratios)}  (server / offline at the same "
            f"concurrency: {spread(same)})"
        )
        if engine_in == "process" and engine_walls:
            print(
                f"server / offline at the same concurrency with the engine process's {engine_threads}: "
                f"{spread([e / r['wall'] for e, r in zip(engine_walls, v)])}"
            )
        print(
            f"server TTFT  p50 {percentile(ttft, 50) * 1e3:8.1f} ms   p99 {percentile(ttft, 99) * 1e3:8.1f} ms  "
            f"(mean {statistics.mean(ttft) * 1e3:.1f} ms at the client, "
            f"{total(v, 'ttft_sum') / total(v, 'ttft_count') * 1e3:.1f} ms inside the server)"
        )
        print(
            f"server ITL   p50 {percentile(itl, 50) * 1e3:8.1f} ms   p99 {percentile(itl, 99) * 1e3:8.1f} ms"
        )
        print(
            f"server engine busy (inside steps) {spread([r['busy'] for r in v], pct=True)} of the wall time"
        )
        where = "HTTP process" if engine_in == "process" else "server's one process (HTTP and engine)"
        cpu = [f"{spread([r['cpu_http'] / n_out * 1e6 for r in v], 0)} µs in the {where}"]
        if engine_in == "process":
            cpu.append(f"{spread([r['cpu_engine'] / n_out * 1e6 for r in v], 0)} µs in the engine process")
        cpu.append(f"{spread([r['cpu_client'] / n_out * 1e6 for r in v], 0)} µs in the client")
        print(f"server CPU time per output token: {', '.join(cpu)}")
        print(f"server outputs equal to offline greedy: {equal}/{len(outs) * len(v)}")


def total(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs)


def spread(xs: list[float], digits: int = 2, pct: bool = False) -> str:
    """``median (min-max)`` of the turns, or the one value."""
    f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.{digits}f}")
    return f(xs[0]) if len(xs) == 1 else f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})"


class Server:
    """`nanolab serve` with its engine in a process or a thread, kept up over every turn."""

    def __init__(self, args: argparse.Namespace, engine_in: str, model_name: str) -> None:
        self.args, self.engine_in, self.model_name = args, engine_in, model_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, prompts, lengths) -> None:
        self.proc = start_server(self.args, self.port, self.engine_in)
        wait_healthy(self.proc, self.url, timeout=120)
        asyncio.run(run_clients(self.url, self.model_name, prompts[:2], lengths[:2], 2, self.args.client))

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)

    def cpu_times(self) -> tuple[float, float]:
        """CPU seconds of the server's own process and of its children (the engine process)."""
        main = psutil.Process(self.proc.pid)
        children = sum(sum(c.cpu_times()[:2]) for c in main.children(recursive=True))
        return sum(main.cpu_times()[:2]), children

    def run(self, prompts, lengths) -> dict:
        """Run the clients once; the wall time, the results and what the server's metrics say about this
        run alone (differences of its counters and histogram sums around it)."""
        keys = (
            "nanolab_engine_step_seconds_total",
            "nanolab_time_to_first_token_seconds_sum",
            "nanolab_time_to_first_token_seconds_count",
            "nanolab_batch_size_sum",
            "nanolab_batch_size_count",
        )
        before = scrape(self.url)
        (http0, engine0), client0 = self.cpu_times(), time.process_time()
        wall, results = asyncio.run(
            asyncio.wait_for(
                run_clients(self.url, self.model_name, prompts, lengths, self.args.clients, self.args.client),
                self.args.timeout,
            )
        )
        (http1, engine1), client1 = self.cpu_times(), time.process_time()
        after = scrape(self.url)
        step_s, ttft_sum, ttft_count, batch_sum, steps = (after[k] - before[k] for k in keys)
        return {
            "wall": wall,
            "results": results,
            "batch_sum": batch_sum,
            "steps": steps,
            "ttft_sum": ttft_sum,
            "ttft_count": ttft_count,
            "busy": step_s / wall,
            "cpu_http": http1 - http0,
            "cpu_engine": engine1 - engine0,
            "cpu_client": client1 - client0,
        }


if __name__ == "__main__":
    main()
