"""Engine throughput on the bundled model vs Hugging Face transformers on the same weights, same run.

Workload: N requests (default 64) with mixed prompt lengths (prompts cut from held-out-style Python
source) and mixed output lengths, greedy, ignore_eos (every system generates exactly the same number of
tokens per request). Baselines, all on the same weights (`nanolab.model.hf.to_hf`):

- HF sequential: `model.generate` one request at a time;
- HF static batching: left-padded batches of `--hf-batch` requests, each batch runs until its longest
  request is done (the tokens generated past a request's length are wasted and not counted).

Prints tokens/s for each and the ratios, the engine's time split per step (model forward vs everything
else: scheduling, batch layout, sampling, detokenization), a shared-system-prompt workload run
with the prefix cache on and off, and parallel sampling: n samples of one long prompt in one request
(the prompt computed once, its blocks shared) against n separate seeded requests, which give the same
tokens. Last, speculative decoding against plain decoding, for the n-gram proposer and the bundled draft
model, on code that repeats itself and on code that does not, one request at a time and as one batch:
throughput, the ratio to plain decoding (median and range of the repeats, measured in the same run),
the share of guesses kept, target forwards per output token, and whether the greedy outputs are
identical. ``--device cuda`` runs the engine and HF on a GPU (and is skipped where there is none).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace

import torch

from nanolab import LLM, SamplingParams, load_model, load_tokenizer
from nanolab.engine.device import DeviceUnavailableError, check_device
from nanolab.engine.stats import StepRecord
from nanolab.model.hf import to_hf
from nanolab.model.loading import ASSETS_DIR


def make_workload(tokenizer, n: int, seed: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """n prompts (8..160 tokens) cut from Python source, and output lengths (16..128 tokens)."""
    import inspect
    import json
    import textwrap

    sources = "".join(inspect.getsource(m) for m in (json, textwrap, random, statistics, argparse))
    ids = tokenizer.encode(sources)
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        plen = rng.randint(8, 160)
        start = rng.randrange(0, len(ids) - plen)
        prompts.append(ids[start : start + plen])
        lengths.append(min(rng.randint(16, 128), max_len - plen))
    return prompts, lengths


def run_engine(llm: LLM, prompts, lengths) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def run_hf_sequential(hf, prompts, lengths, progress) -> tuple[float, list[list[int]]]:
    results = []
    t0 = time.perf_counter()
    for p, n in progress(list(zip(prompts, lengths)), desc="HF sequential"):
        x = torch.tensor([p], device=hf.device)
        y = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        results.append(y[0, len(p) :].tolist())
    return time.perf_counter() - t0, results


@torch.inference_mode()
def run_hf_static(hf, prompts, lengths, batch: int, pad_id: int, progress) -> float:
    t0 = time.perf_counter()
    for i in progress(range(0, len(prompts), batch), desc="HF static batches"):
        ps, ns = prompts[i : i + batch], lengths[i : i + batch]
        width = max(map(len, ps))
        x = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=hf.device)
        hf.generate(x, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns), do_sample=False)
    return time.perf_counter() - t0


def overhead_at_batch(
    model, tokenizer, batch: int, device: str, prompt_len: int = 64, out_len: int = 48
) -> tuple[float, float, int]:
    """Fraction of step time outside the model forward, over steps that decode exactly `batch` requests."""
    records: list[StepRecord] = []
    llm = LLM(model, tokenizer, listeners=[records.append], device=device)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True), use_tqdm=False)
    steps = [(r.forward_seconds, r.step_seconds) for r in records if r.num_seqs == batch == r.num_tokens]
    fwd, total = sum(f for f, _ in steps), sum(s for _, s in steps)
    return 1 - fwd / total, total / len(steps), len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small workload (for a smoke test)")
    parser.add_argument("--device", default="cpu", help="torch device of the engine and HF (cpu, cuda, ...)")
    args = parser.parse_args()
    try:
        device = str(check_device(args.device))
    except DeviceUnavailableError as e:
        print(f"bench_engine: skipped: {e}")
        return
    except ValueError as e:
        parser.error(str(e))
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    if tokenizer is None:
        sys.exit("this benchmark needs a checkpoint with a nanolab tokenizer")
    n = 8 if args.quick else args.requests
    prompts, lengths = make_workload(tokenizer, n, args.seed, model.config.max_seq_len)
    total = sum(lengths)
    print(
        f"workload: {n} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"outputs {min(lengths)}..{max(lengths)} tokens, {total} output tokens in all"
    )
    print(
        f"model: {model.num_parameters() / 1e6:.1f}M parameters, torch threads: {torch.get_num_threads()}, "
        f"device: {device}"
    )

    llm = LLM(model, tokenizer, device=device)
    run_engine(llm, prompts[:4], lengths[:4])  # warm-up
    t_engine, engine_out = run_engine(LLM(model, tokenizer, device=device), prompts, lengths)

    hf = to_hf(model).to(device).eval()
    pad = tokenizer.eos_token_id or 0
    hf.generation_config.pad_token_id = pad
    t_seq, hf_out = run_hf_sequential(hf, prompts, lengths, tqdm)
    t_static = run_hf_static(hf, prompts, lengths, args.hf_batch, pad, tqdm)
    same = sum(a == b for a, b in zip(engine_out, hf_out))

    rows = [
        ("nanolab engine", t_engine),
        ("HF sequential", t_seq),
        (f"HF static batch {args.hf_batch}", t_static),
    ]
    print(f"\n{'system':<22}{'time (s)':>10}{'tokens/s':>12}{'engine speedup':>16}")
    for name, t in rows:
        print(f"{name:<22}{t:>10.2f}{total / t:>12.1f}{t / t_engine:>15.2f}x")
    print(f"greedy outputs identical to HF sequential: {same}/{n}")

    batch = min(64, n)
    runs = sorted(overhead_at_batch(model, tokenizer, batch, device) for _ in range(3))
    frac, step_s, nsteps = runs[1]  # the median run; the range shows how much the machine moved it
    print(
        f"\nstep time split at batch {batch} (decode, {nsteps} steps, {step_s * 1e3:.1f} ms/step, median "
        f"of 3 runs): model forward {100 * (1 - frac):.1f}%, everything else {100 * frac:.1f}% "
        f"(runs: {', '.join(f'{100 * r[0]:.1f}%' for r in runs)})"
    )

    # Shared system prompt: the radix cache computes it once.
    system = tokenizer.encode(
        '"""You are a helpful assistant that writes clean, well-documented Python code.\n'
        'Follow PEP 8, add type hints and docstrings, and prefer the standard library."""\n' * 3
    )
    shared = [system + p[:32] for p in prompts]
    outs = [min(n_, 32) for n_ in lengths]
    print(f"\nshared system prompt ({len(system)} tokens) + 8..32 own tokens, {n} requests:")
    results = {}
    for on in (True, False):
        llm = LLM(model, tokenizer, enable_prefix_caching=on, device=device)
        t, _ = run_engine(llm, shared, outs)
        st = llm.stats()
        results[on] = t
        saved = st.prefix_cached_tokens
        bs = llm.engine.config.block_size
        # what whole blocks can share: the system prompt's, for every request after the first
        shareable = (len(system) // bs) * bs * (len(shared) - 1)
        print(
            f"  prefix cache {'on ' if on else 'off'}: {t:6.2f} s, {sum(outs) / t:7.1f} tokens/s, "
            f"prefill tokens saved: {saved} ({saved / shareable:.0%} of the {shareable} whole blocks can share), "
            f"hit rate {st.prefix_hit_rate:.1%}"
        )
    print(f"  cache on / off throughput: {results[False] / results[True]:.2f}x")
    parallel_sampling(model, tokenizer, prompts, n=4 if args.quick else 8, device=device)
    speculative(model, tokenizer, prompts, quick=args.quick, device=device)


DRAFT = "tinypy-draft"  # the bundled draft model of tinypy
FIELDS = ("name", "size", "color", "owner", "price", "weight", "label", "shape")


def speculative(model, tokenizer, prompts, quick: bool, device: str) -> None:
    """Speculative vs plain decoding on two workloads, one request at a time and as one batch."""
    n, out_len, repeats = (2, 24, 1) if quick else (8, 96, 3)
    rng = random.Random(1)
    repeating = []
    for i in range(n):  # classes of getters: the continuation repeats what the prompt shows
        names = rng.sample(FIELDS, 4)
        body = "".join(f"    def get_{f}(self):\n        return self._{f}\n\n" for f in names)
        repeating.append(tokenizer.encode(f"class Thing{i}:\n{body}"))
    workloads = {"repeats itself": repeating, "does not repeat": [p[:64] for p in prompts[:n]]}
    methods: dict[str, dict | None] = {
        "plain": None,
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    }
    if (ASSETS_DIR / DRAFT).is_dir():
        methods["draft k=4"] = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}
    else:
        print(f"\n(no bundled {DRAFT}: the draft model rows are left out)")
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    print(
        f"\nspeculative decoding: {n} prompts per workload, {out_len} greedy tokens each, {repeats} repeat(s)"
    )
    print(
        f"{'workload':<17}{'mode':<15}{'method':<11}{'tokens/s':>10}{'x plain':>9}{'  (range)':<16}{'kept':>7}{'fwd/tok':>9}  same"
    )
    for wname, wprompts in workloads.items():
        for mode in ("one at a time", "batch"):
            times: dict[str, list[float]] = {m: [] for m in methods}
            results = {}
            for c in methods.values():  # warm-up, on engines of its own (their stats are not reported)
                LLM(model, tokenizer, speculative_config=c, device=device).generate(
                    wprompts[0], replace(params, max_tokens=8), use_tqdm=False
                )
            llms = {m: LLM(model, tokenizer, speculative_config=c, device=device) for m, c in methods.items()}
            for _ in range(repeats):  # the methods take turns, so the machine's drift hits them alike
                for m, llm in llms.items():
                    t0 = time.perf_counter()
                    if mode == "batch":
                        outs = llm.generate(wprompts, params, use_tqdm=False)
                    else:
                        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in wprompts]
                    times[m].append(time.perf_counter() - t0)
                    results[m] = [o.outputs[0].token_ids for o in outs]
            total = n * out_len
            for m, llm in llms.items():
                st = llm.stats()
                ratios = sorted(b / t for b, t in zip(times["plain"], times[m]))
                kept = f"{st.spec_acceptance_rate:.0%}" if st.spec_draft_tokens else "-"
                same = sum(a == b for a, b in zip(results["plain"], results[m]))
                print(
                    f"{wname:<17}{mode:<15}{m:<11}{total / statistics.median(times[m]):>10.1f}"
                    f"{statistics.median(ratios):>8.2f}x  ({ratios[0]:.2f}-{ratios[-1]:.2f}){'':<4}"
                    f"{kept:>7}{st.forwards_per_token:>9.2f}  {same}/{n}"
                )


def parallel_sampling(model, tokenizer, prompts, n: int, device: str) -> None:
    """One request with n samples vs n requests seeded seed + i (the same tokens), prefix cache off."""
    prompt = [t for p in prompts for t in p][:200]
    print(f"\nparallel sampling: n={n} samples of one {len(prompt)}-token prompt, 32 tokens each:")
    runs = {}
    for together in (True, False):
        llm = LLM(model, tokenizer, enable_prefix_caching=False, block_size=16, device=device)
        params = SamplingParams(max_tokens=32, temperature=0.8, seed=1, ignore_eos=True)
        t0 = time.perf_counter()
        if together:
            outs = [
                c.token_ids for c in llm.generate(prompt, replace(params, n=n), use_tqdm=False)[0].outputs
            ]
        else:
            seeded = [replace(params, seed=1 + i) for i in range(n)]
            outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, seeded, use_tqdm=False)]
        t = time.perf_counter() - t0
        st = llm.stats()
        blocks = round(st.peak_kv_block_usage * st.kv_blocks_total)
        runs[together] = (t, outs)
        name = "one request, n samples" if together else f"{n} separate requests "
        print(
            f"  {name}: {t:6.2f} s, prompt tokens computed {st.batched_tokens - n * 31}, peak KV blocks {blocks}"
        )
    same = sum(a == b for a, b in zip(runs[True][1], runs[False][1]))
    print(f"  samples identical to the separate seeded requests: {same}/{n}")
    print(f"  n samples / separate requests throughput: {runs[False][0] / runs[True][0]:.2f}x")


if __name__ == "__main__":
    main()
