"""How close nanolab's forward comes to this machine's limits, both measured in the same run.

    python bench/bench_roofline.py            # a GPT-2-small-shaped model: 12 layers, 768 wide, ~89M parameters
    python bench/bench_roofline.py --quick    # a 2-layer, 256-wide model: a smoke test
    python bench/bench_roofline.py --device cuda   # the limits, the engine and HF on a GPU (skipped without one)
    python bench/bench_roofline.py --prepack-weights   # the engine's products through EngineConfig.prepack_weights

The limits, measured first (and again beside each run of the engine, below):

- **matmul peak**: fp32 FLOP/s of a product of square matrices (2048, or 512 with --quick), on every
  thread torch has, the best of several rounds: the faster of ``torch.mm`` and, on the CPU, oneDNN's
  product on a layout of the weight (the one ``prepack_weights`` uses), since neither library is the
  faster one on every CPU (MKL leaves AVX-512 unused on AMD's);
- **memory bandwidth**: bytes per second copying a buffer much larger than the caches (256 MB, read
  and written: twice its size moved per copy), the best of several rounds.

Then nanolab's engine on a model of random weights (built offline, no download), decoding only (the
prompts are short and their steps are left out), three runs of each batch size. Other programs' load
comes and goes on a shared machine, so each run is compared with the limit measured just before and
just after it, the higher of the two; the share printed is the median of the three runs':

- **batch 1**: the weights are read once per token, so tokens/s x the bytes read per token (every
  weight matrix and the output layer, fp32) is the bandwidth the decode reached, as a share of the
  measured bandwidth;
- **batch 64**: tokens/s x the FLOPs per token (2 per weight of every matrix the token goes through,
  the output layer included, plus attention over the context so far) is the FLOP/s the decode reached,
  as a share of the measured matmul peak.

Then what bounds both: the model's matrix products alone (every `nn.Linear` a token goes through, the
output layer included, on random rows and nothing else, multiplied as the engine does) at 16, 32 and 64
rows, as a share of the highest matmul peak measured. Batch-64 decode can reach at most the 64-row
figure; and since HF's static batches of 16 take two products of 16 rows (by F.linear) where the engine
takes one of 32, twice HF's 16-row time over the engine's 32-row time bounds how much faster than HF the
engine can be, before HF's own per-step overhead.

Last, 32 requests of 32 tokens, greedy: nanolab's `LLM` against Hugging Face transformers' ``generate`` in
left-padded static batches of 16 on the same weights (`nanolab.model.hf.to_hf`), three runs of each
taking turns: tokens/s, the median ratio and its range, and how many outputs are identical (a random
model has near-ties between its top two logits, where the two implementations' float rounding may pick
differently; those are counted, not hidden).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from nanolab import LLM, SamplingParams
from nanolab.engine.device import DeviceUnavailableError, check_device
from nanolab.engine.stats import StepRecord
from nanolab.model import prepacked
from nanolab.model.config import ModelConfig
from nanolab.model.hf import to_hf
from nanolab.model.prepacked import Prepacked, linear
from nanolab.model.transformer import Transformer


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; the CPU has nothing to wait for)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, rounds: int, device: torch.device | None = None) -> float:
    """The shortest of ``rounds`` timed calls of ``fn`` (seconds): on a shared machine the slow ones are
    other programs' time."""
    fn()
    synchronize(device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(n: int, device: torch.device, rounds: int = 5) -> float:
    """fp32 FLOP/s of an n x n matrix product: torch.mm's, or on the CPU oneDNN's where that is faster."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    seconds = best_of(lambda: torch.mm(a, b), rounds, device)
    if device.type == "cpu" and prepacked.available():
        packed = prepacked.layout(b)
        seconds = min(seconds, best_of(lambda: prepacked.onednn_linear(a, packed), rounds, device))
    return 2 * n**3 / seconds


def memory_bandwidth(megabytes: int, device: torch.device, rounds: int = 5) -> float:
    """Bytes per second copying a buffer of ``megabytes`` into another (each byte read once, written once)."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src), rounds, device)


def model_config(quick: bool) -> ModelConfig:
    """The bench's model: GPT-2-small-shaped (12 layers, 768 wide, a 4,096-token vocabulary), or with
    ``quick`` 2 layers, 256 wide."""
    if quick:
        return ModelConfig(arch="gpt2", vocab_size=512, n_layers=2, n_heads=4, n_kv_heads=4, d_model=256,
                           d_ff=1024, max_seq_len=256)  # fmt: skip
    return ModelConfig(arch="gpt2", vocab_size=4096, n_layers=12, n_heads=12, n_kv_heads=12, d_model=768,
                       d_ff=3072, max_seq_len=512)  # fmt: skip


def make_model(config: ModelConfig, seed: int) -> Transformer:
    """Random weights, larger than the training init so that the logits are spread out."""
    model = Transformer(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
    return model.eval()


def matrix_weights(config: ModelConfig) -> int:
    """Weights of the matrices one token goes through: each layer's attention and MLP, and the output layer."""
    d, f = config.d_model, config.d_ff
    kv = config.n_kv_heads * config.head_dim
    attention = d * d + 2 * d * kv + d * d  # q, k, v, out
    mlp = (3 if config.arch == "llama" else 2) * d * f
    return config.n_layers * (attention + mlp) + d * config.vocab_size


def decode_rate(
    model: Transformer,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
    device: torch.device,
    prepack_weights: bool = False,
) -> float:
    """Tokens/s over the pure decode steps of ``batch`` requests (their mean context: ``prompt_len +
    new_tokens / 2``)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    records: list[StepRecord] = []
    llm = LLM(
        model,
        None,
        block_size=16,
        num_blocks=batch * 8 + 16,
        max_num_seqs=batch,
        listeners=[records.append],
        device=device,
        prepack_weights=prepack_weights,
    )
    llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False
    )
    decode = [r for r in records if r.num_tokens == r.num_seqs == batch]
    tokens = sum(r.num_generated for r in decode)
    return tokens / sum(r.step_seconds for r in decode)


def beside_limits(run, limit, rounds: int = 3) -> list[tuple[float, float]]:
    """``rounds`` runs (``run(seed)``), each with the machine's limit measured just before and just after
    it: [(the run's result, the higher of the two limits)]. Other programs' load comes and goes on a
    shared machine, and a limit measured in a busy spell would flatter a run measured in a quiet one."""
    limits = [limit()]
    results = []
    for seed in range(rounds):
        results.append(run(seed))
        limits.append(limit())
    return [(r, max(limits[i], limits[i + 1])) for i, r in enumerate(results)]


def products_seconds(
    model: Transformer, rows: int, device: torch.device, prepack_weights: bool = False
) -> float:
    """Seconds for ``rows`` token rows to go through every matrix of ``model`` once (best of several), as the
    engine multiplies them: with ``prepack_weights``, the layers' through their oneDNN layouts (at 1 or 2 rows,
    nanolab's kernel)."""
    linears = list(dict.fromkeys(m for m in model.modules() if isinstance(m, torch.nn.Linear)))
    inputs = {m.in_features: torch.randn(rows, m.in_features, device=device) for m in linears}
    layouts = Prepacked.for_model(model).active() if prepack_weights else contextlib.nullcontext()

    def run() -> None:
        with torch.inference_mode():
            for m in linears:
                linear(inputs[m.in_features], m.weight, m.bias)

    with layouts:
        return best_of(run, 5, device)


def hf_static(hf, prompts: list[list[int]], new_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds and outputs of HF generate, greedy, in left-padded static batches of ``batch``."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        outputs += out[:, width:].tolist()
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and workload (a smoke test)")
    parser.add_argument(
        "--device", default="cpu", help="torch device of the limits, the engine and HF (cpu, cuda, ...)"
    )
    parser.add_argument(
        "--prepack-weights",
        action="store_true",
        help="the engine's layers multiply through oneDNN's layouts of the weights, and at 1 or 2 rows through "
        "nanolab's kernel (EngineConfig.prepack_weights)",
    )
    args = parser.parse_args()
    try:
        device = check_device(args.device)
    except DeviceUnavailableError as e:
        print(f"bench_roofline: skipped: {e}")
        return
    except ValueError as e:
        parser.error(str(e))
    if args.prepack_weights and device.type != "cpu":
        parser.error(
            "--prepack-weights lays the weights out for oneDNN on the CPU; leave it off with --device"
        )
    config = model_config(args.quick)
    if args.quick:
        n_mm, megabytes, big_batch, new_tokens, requests = 512, 64, 8, 8, 8
    else:
        n_mm, megabytes, big_batch, new_tokens, requests = 2048, 256, 64, 32, 32
    where = f"{torch.get_num_threads()} torch threads"
    if device.type == "cuda":
        where = f"{device}: {torch.cuda.get_device_name(device)}"
    peak = matmul_peak(n_mm, device)
    bandwidth = memory_bandwidth(megabytes, device)
    print(
        f"limits ({where}): fp32 matmul {peak / 1e9:.1f} GFLOP/s, memory bandwidth {bandwidth / 1e9:.1f} GB/s"
    )

    model = make_model(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    weights = matrix_weights(config)
    print(f"model: {config.arch}, {config.n_layers} layers x {config.d_model} wide, {params / 1e6:.1f}M parameters "
          f"({weights / 1e6:.1f}M in the matrices a token goes through); the engine's products: "
          f"{'oneDNN layouts of the weights, 1-2 rows by linear_rows (prepack_weights)' if args.prepack_weights else 'F.linear'}")  # fmt: skip

    runs = beside_limits(lambda seed: decode_rate(model, 1, 8, new_tokens, seed, device, args.prepack_weights),
                         lambda: memory_bandwidth(megabytes, device, rounds=3))  # fmt: skip
    rate1 = statistics.median(rate for rate, _ in runs)
    shares = sorted(rate * 4 * weights / limit for rate, limit in runs)
    print(
        f"decode, batch 1: {rate1:7.1f} tokens/s (runs: {', '.join(f'{r:.1f}' for r, _ in runs)}): "
        f"{rate1 * 4 * weights / 1e9:.1f} GB/s of weights read, {statistics.median(shares):.0%} of the measured "
        f"bandwidth (runs: {shares[0]:.0%} to {shares[-1]:.0%})"
    )
    ctx = 8 + new_tokens / 2  # the mean context of the decode steps
    flops = 2 * weights + 4 * config.n_layers * ctx * config.d_model  # the matrices, then q.k and p.v
    runs = beside_limits(lambda seed: decode_rate(model, big_batch, 8, new_tokens, seed, device, args.prepack_weights),
                         lambda: matmul_peak(n_mm, device, rounds=3))  # fmt: skip
    rate64 = statistics.median(rate for rate, _ in runs)
    shares = sorted(rate * flops / limit for rate, limit in runs)
    print(
        f"decode, batch {big_batch}: {rate64:7.1f} tokens/s (runs: {', '.join(f'{r:.1f}' for r, _ in runs)}): "
        f"{rate64 * flops / 1e9:.1f} GFLOP/s, {statistics.median(shares):.0%} of the measured matmul peak "
        f"(runs: {shares[0]:.0%} to {shares[-1]:.0%})"
    )

    peak = max(peak, *(limit for _, limit in runs))  # the highest measured so far
    seconds = {
        rows: products_seconds(model, rows, device, args.prepack_weights)
        for rows in sorted({16, 32, big_batch})
    }
    hf16 = products_seconds(model, 16, device) if args.prepack_weights else seconds[16]  # HF: F.linear
    print(
        "matrix products alone: "
        + ", ".join(
            f"{rows} rows {t * 1e3:.1f} ms ({2 * weights * rows / t / peak:.0%} of peak)"
            for rows, t in seconds.items()
        )
        + f"; HF's two batches of 16 over the engine's one of 32: {2 * hf16 / seconds[32]:.2f}x at most, "
        "before HF's per-step overhead"
    )

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 33, (requests,), generator=g)]  # fmt: skip
    hf = to_hf(model).to(device).eval()
    engine = LLM(
        model,
        None,
        block_size=16,
        num_blocks=requests * 8 + 16,
        max_num_seqs=requests,
        device=device,
        prepack_weights=args.prepack_weights,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {"hf": [], "engine": []}
    same, total = requests, requests * new_tokens
    for round_ in range(3):  # HF first, then the engine first, then HF first: a busy spell hits both
        for who in ("hf", "engine") if round_ % 2 == 0 else ("engine", "hf"):
            if who == "hf":
                took, hf_out = hf_static(hf, prompts, new_tokens, 16)
            else:
                start = time.perf_counter()
                ours = engine.generate(prompts, params, use_tqdm=False)
                took = time.perf_counter() - start
            rates[who].append(total / took)
        same = min(same, sum(o.outputs[0].token_ids == h for o, h in zip(ours, hf_out)))
    ratios = sorted(e / h for e, h in zip(rates["engine"], rates["hf"]))
    print(f"{requests} requests x {new_tokens} tokens, greedy: nanolab {statistics.median(rates['engine']):.1f} "
          f"tokens/s, HF static batches of 16 {statistics.median(rates['hf']):.1f} tokens/s: "
          f"{statistics.median(ratios):.2f}x (runs: {ratios[0]:.2f}x to {ratios[-1]:.2f}x); identical outputs "
          f"{same} of {requests} in every run")  # fmt: skip


if __name__ == "__main__":
    main()
