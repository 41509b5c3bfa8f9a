"""The layers' matrix products at a few rows: F.linear, oneDNN's prepacked layouts and nanolab's kernel.

A decode step at batch 1 or 2 multiplies one or two rows by every weight matrix of the model, and all there
is to such a product is reading the weight from memory. This bench runs the matrices of a GPT-2-small-shaped
layer (768 wide, 3072 in the MLP), 10 copies of each so that they do not fit in the caches, one after
another, at 1 to 8 rows, each way:

- ``F.linear``: MKL's sgemm, the engine's default;
- oneDNN: ``torch.ops.mkldnn._linear_pointwise`` on layouts made once (``prepack_weights``, 3 rows or more);
- ``linear_rows``: ``nanolab._C.linear_rows``, reading the weight as it is (``prepack_weights``, 1 or 2 rows).

It prints the weights read per second and each way's time as a multiple of F.linear's, beside the rate at
which the machine reads a buffer of the same size (``torch.sum``), all on every thread torch has, taking
turns in a shuffled order, best of several rounds; and checks that the three agree.

With ``--engine`` it then decodes ``bench/bench_roofline.py``'s GPT-2-small-shaped model with the engine at
batch 1 to 64, with and without ``prepack_weights``, the two taking turns, three runs each: tokens/s over
the decode steps, and the median speed-up with its range.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_attention import race
from bench_roofline import decode_rate, make_model, model_config

from nanolab.model.config import ModelConfig
from nanolab.model.prepacked import (
    HAS_KERNEL,
    KERNEL_MAX_ROWS,
    _linear_rows,
    available,
    layout,
    onednn_linear,
)


def ways(
    xs: dict[int, torch.Tensor], weights: list[torch.Tensor], biases: list[torch.Tensor], packed: list | None
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each way of multiplying the rows ``xs`` (by width) by every weight in turn."""
    fns = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w, b) for w, b in zip(weights, biases)]}
    if packed is not None:
        fns["oneDNN"] = lambda: [
            onednn_linear(xs[w.shape[1]], p, b) for w, p, b in zip(weights, packed, biases)
        ]
    if HAS_KERNEL:
        fns["linear_rows"] = lambda: [_linear_rows(xs[w.shape[1]], w, b) for w, b in zip(weights, biases)]
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds spent timing each way")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="then the engine's decode at batch 1 to 64 with and without prepack_weights (about a minute)",
    )
    parser.add_argument("--quick", action="store_true", help="small matrices, short timings (a smoke test)")
    args = parser.parse_args()
    config = model_config(args.quick)
    d, f, copies = config.d_model, config.d_ff, 10
    batches, new_tokens = [1, 2, 3, 4, 8, 16, 64], 32
    if args.quick:
        copies, args.rows, args.min_time = 2, [1, 3], 0.01
        batches, new_tokens = [1, 3], 4
    gen = torch.Generator().manual_seed(0)
    shapes = [(3 * d, d), (d, d), (f, d), (d, f)] * copies  # q/k/v, out, MLP up, MLP down
    weights = [torch.randn(shape, generator=gen) * 0.05 for shape in shapes]
    biases = [torch.randn(shape[0], generator=gen) for shape in shapes]
    packed = [layout(w) for w in weights] if available() else None
    nbytes = sum(w.numel() for w in weights) * 4
    buffer = torch.ones(nbytes // 4)

    print(f"matrix products, fp32, {torch.get_num_threads()} torch threads: {len(weights)} matrices of a "
          f"{d}-wide layer, {nbytes / 2**20:.1f} MB of weights")  # fmt: skip
    if packed is None:
        print("  (this build of torch lacks oneDNN: no oneDNN column)")
    if not HAS_KERNEL:
        print("  (the C++ kernels are not built or NANOLAB_PURE_PYTHON is set: no linear_rows column)")
    read = race({"read": lambda: buffer.sum()}, args.min_time)["read"]
    print(f"reading a buffer of that size: {nbytes / read / 1e6:.1f} GB/s")
    print("\nrows   weights read per second, GB/s (time / F.linear's)")
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in (d, f)}
        fns = ways(xs, weights, biases, packed)
        want = fns["F.linear"]()
        for name, fn in fns.items():
            for got, ref in zip(fn(), want):
                torch.testing.assert_close(
                    got, ref, rtol=1e-4, atol=1e-4, msg=f"{name} disagrees with F.linear"
                )
        ms = race(fns, args.min_time)
        cells = [
            f"{name} {nbytes / t / 1e6:6.1f} ({t / ms['F.linear']:4.2f}x)"
            + (
                " *"
                if name == ("linear_rows" if rows <= KERNEL_MAX_ROWS and HAS_KERNEL else "oneDNN")
                else ""
            )
            for name, t in ms.items()
        ]
        print(f"{rows:>4}   " + "   ".join(cells))
    print("\n* what prepack_weights uses at that many rows; every way agrees with F.linear (checked)")
    if args.engine:
        engine_decode(config, batches, new_tokens)


def engine_decode(config: ModelConfig, batches: list[int], new_tokens: int) -> None:
    """The engine's decode tokens/s with and without prepack_weights, taking turns, three runs each."""
    if not available():
        print("\nengine decode: skipped (prepack_weights needs oneDNN)")
        return
    model = make_model(config, seed=0)
    cpu = torch.device("cpu")
    print(
        f"\nengine decode, {config.n_layers} layers x {config.d_model} wide: tokens/s, F.linear (the default) "
        "and prepack_weights"
    )
    for batch in batches:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for run in range(3):
            for prepack in (False, True) if run % 2 == 0 else (True, False):
                rates[prepack].append(decode_rate(model, batch, 8, new_tokens, run, cpu, prepack))
        ratios = sorted(p / o for p, o in zip(rates[True], rates[False]))
        print(
            f"  batch {batch:>3}: {statistics.median(rates[False]):8.1f}  {statistics.median(rates[True]):8.1f}  "
            f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}x to {ratios[-1]:.2f}x)"
        )


if __name__ == "__main__":
    main()
