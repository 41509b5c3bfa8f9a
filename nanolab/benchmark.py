"""`nanolab bench`: throughput and latency of the engine on a synthetic workload.

Prompts are random token ids of mixed lengths (uniform in [input_len / 2, 3 * input_len / 2]), outputs
likewise around output_len, greedy with ignore_eos so every request generates exactly its length. All
requests arrive at once (an offline batch). For comparisons against other systems see bench/.
"""

from __future__ import annotations

import argparse
import random
import statistics


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_benchmark(args: argparse.Namespace) -> int:
    from nanolab.engine.llm import LLM
    from nanolab.model.sampling import SamplingParams

    llm = LLM.from_cli_args(args)
    max_len = llm.engine.config.max_model_len
    vocab = llm.model.config.vocab_size
    rng = random.Random(args.seed)
    prompts, params = [], []
    for _ in range(args.num_prompts):
        p = rng.randint(max(1, args.input_len // 2), max(1, 3 * args.input_len // 2))
        o = rng.randint(max(1, args.output_len // 2), max(1, 3 * args.output_len // 2))
        p = min(p, max_len - 1)
        o = min(o, max_len - p)
        prompts.append([rng.randrange(vocab) for _ in range(p)])
        params.append(SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))

    outs = llm.generate(prompts, params)
    st = llm.stats()
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.time_per_output_token for o in outs if o.metrics.time_per_output_token is not None]
    span = max(o.metrics.finish_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    print(f"requests: {len(outs)}, prompt tokens: {n_in}, output tokens: {n_out}, wall: {span:.2f} s")
    print(
        f"throughput: {len(outs) / span:.2f} req/s, {n_out / span:.1f} output tokens/s, {(n_in + n_out) / span:.1f} total tokens/s"
    )
    print(f"TTFT   p50 {percentile(ttft, 50) * 1e3:8.1f} ms   p99 {percentile(ttft, 99) * 1e3:8.1f} ms")
    if tpot:
        print(
            f"TPOT   p50 {percentile(tpot, 50) * 1e3:8.1f} ms   p99 {percentile(tpot, 99) * 1e3:8.1f} ms   "
            f"mean {statistics.mean(tpot) * 1e3:.1f} ms"
        )
    print(
        f"steps: {st.steps}, mean batch size: {st.mean_batch_size:.1f}, "
        f"model forward share of step time: {st.forward_fraction:.0%}"
    )
    print(
        f"peak KV block usage: {st.peak_kv_block_usage:.0%} of {st.kv_blocks_total} blocks, "
        f"preemptions: {st.preemptions}, prefix hit rate: {st.prefix_hit_rate:.1%}"
    )
    if llm.engine.speculator is not None:
        print(
            f"speculative decoding: guesses kept {st.spec_accepted_tokens} of {st.spec_draft_tokens} "
            f"({st.spec_acceptance_rate:.0%}), {st.spec_mean_accepted:.2f} per check, "
            f"{st.forwards_per_token:.2f} model forwards per output token"
        )
    return 0
