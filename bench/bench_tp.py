"""Tensor parallelism on this machine: one model split over 2 processes against the same model in one.

    python bench/bench_tp.py            # the bundled model, and random models 512 and 1024 wide
    python bench/bench_tp.py --quick    # the bundled model only, fewer tokens: a smoke test

Both layouts get the same cores: the whole model runs on every thread torch has (T), the split one on
T / 2 threads in each process. For each model, in one run and for several rounds (median and range):

- tokens/s of greedy decoding for a batch of requests, TP=2 / TP=1 (above 1: the split is faster);
- the share of the driver's step time spent in the all-reduces (waiting for the other rank included)
  and in broadcasting the step, counted by wrapping the driver's process group;
- the bytes one all-reduce moves per token (a d_model-wide fp32 vector: 2 per layer), counted;
- whether the outputs are identical (a near-tie between the top two logits may flip, since the sum over
  ranks rounds differently: those are reported, not hidden).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from nanolab import LLM, SamplingParams
from nanolab.engine.tensor_parallel import set_group
from nanolab.model.config import ModelConfig
from nanolab.model.loading import load_model
from nanolab.model.tensor_parallel import TPShard
from nanolab.model.transformer import Transformer


class TimedGroup:
    """A process group that counts the all-reduces and broadcasts through it, their bytes and time."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.seconds = {"allreduce": 0.0, "broadcast": 0.0}
        self.calls = {"allreduce": 0, "broadcast": 0}
        self.bytes = 0

    def rank(self) -> int:
        return self.group.rank()

    def _timed(self, kind: str, tensors: list[torch.Tensor], *args: Any) -> Any:
        start = time.perf_counter()
        work = getattr(self.group, kind)(tensors, *args)
        work.wait()
        self.seconds[kind] += time.perf_counter() - start
        self.calls[kind] += 1
        if kind == "allreduce":
            self.bytes += sum(t.nbytes for t in tensors)
        return work  # done: the caller's wait() returns at once

    def allreduce(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        return self._timed("allreduce", tensors, *args)

    def broadcast(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        return self._timed("broadcast", tensors, *args)


def timed(llm: LLM) -> TimedGroup:
    """Wrap the driver's process group (every layer's and the runner's) in a `TimedGroup`."""
    runner = llm.engine.runner
    group = TimedGroup(runner._group)
    runner._group = group
    set_group(runner.model, TPShard(0, runner.size, group))
    return group


def random_model(width: int) -> Transformer:
    config = ModelConfig(n_layers=4, n_heads=8, n_kv_heads=8, d_model=width, d_ff=4 * width, vocab_size=512)
    torch.manual_seed(0)
    return Transformer(config).eval()


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(prompts) * tokens / elapsed, [o.outputs[0].token_ids for o in outs]


def bench(name: str, model: Transformer, batch: int, tokens: int, rounds: int) -> None:
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(batch)]
    settings = dict(max_num_seqs=batch, enable_prefix_caching=False)
    whole = LLM(model, **settings)
    torch.set_num_threads(max(1, threads // 2))
    split = LLM(model, tensor_parallel_size=2, **settings)
    group = timed(split)
    ratios, shares, comm_shares, tp1, tp2 = [], [], [], [], []
    try:
        for _ in range(rounds):
            torch.set_num_threads(threads)
            a, want = run(whole, prompts, tokens)
            torch.set_num_threads(max(1, threads // 2))
            before = dict(group.seconds), group.bytes, group.calls["allreduce"]
            start = time.perf_counter()
            b, got = run(split, prompts, tokens)
            elapsed = time.perf_counter() - start
            reduce_s = group.seconds["allreduce"] - before[0]["allreduce"]
            bcast_s = group.seconds["broadcast"] - before[0]["broadcast"]
            tp1.append(a)
            tp2.append(b)
            ratios.append(b / a)
            shares.append(reduce_s / elapsed)
            comm_shares.append((reduce_s + bcast_s) / elapsed)
            calls = group.calls["allreduce"] - before[2]
            moved = group.bytes - before[1]
    finally:
        split.close()
        torch.set_num_threads(threads)
    c = model.config
    per_token = moved / (len(prompts) * (tokens - 1) + sum(len(p) for p in prompts))  # tokens run through
    same = sum(w == x for w, x in zip(want, got))
    print(
        f"\n{name}: {c.n_layers} layers, d_model {c.d_model}, batch {batch} x {tokens} tokens, {threads} threads"
    )
    print(f"  TP=1 {statistics.median(tp1):8.1f} tok/s   TP=2 {statistics.median(tp2):8.1f} tok/s")
    print(
        f"  TP=2 / TP=1: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
    )
    print(
        f"  share of the driver's time in all-reduces: {statistics.median(shares):.0%} "
        f"(with the step broadcast: {statistics.median(comm_shares):.0%})"
    )
    print(
        f"  all-reduces per step: {calls / max(1, tokens):.0f} (2 per layer); bytes all-reduced per token: "
        f"{per_token:.0f} (2 x {c.n_layers} layers x {c.d_model} x 4 B = {2 * c.n_layers * c.d_model * 4})"
    )
    print(f"  identical outputs: {same}/{len(want)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bundled model only, fewer tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    bench("bundled tinypy", load_model(), 8, 16 if args.quick else 48, rounds)
    if not args.quick:
        for width in (512, 1024):
            bench(f"random, {width} wide", random_model(width), 8, 32, rounds)


if __name__ == "__main__":
    main()
