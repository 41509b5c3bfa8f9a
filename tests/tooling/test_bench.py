"""The benchmarks still run end to end (small workloads) and their correctness lines hold.

Only what does not depend on the machine is asserted: outputs equal to the baselines and every report
line present. Timings and ratios are the benchmarks' business, never a test's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(name: str, *flags: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", *flags], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(600)
def test_bench_engine_quick():
    out = run_bench("bench_engine.py")
    n = int(re.search(r"workload: (\d+) requests", out).group(1))
    assert f"greedy outputs identical to HF sequential: {n}/{n}" in out
    for label in (
        "nanolab engine",
        "HF sequential",
        "HF static batch",
        "prefix cache on",
        "prefix cache off",
    ):
        assert label in out, f"no {label!r} line in:\n{out}"
    split = re.search(r"model forward ([\d.]+)%, everything else ([\d.]+)%", out)
    assert split and abs(float(split.group(1)) + float(split.group(2)) - 100) < 0.2
    saved = re.search(
        r"prefix cache on .*prefill tokens saved: (\d+) \((\d+)% of the (\d+) whole blocks", out
    )
    assert saved and int(saved.group(1)) > 0, (
        "the shared system prompt saved no prefill with the prefix cache on"
    )
    # the shared prefix is computed once: every whole block that can be shared is served from the cache
    assert int(saved.group(1)) == int(saved.group(3)), out
    m = re.search(r"samples identical to the separate seeded requests: (\d+)/(\d+)", out)
    assert m and m.group(1) == m.group(2), out
    computed = [int(x) for x in re.findall(r"prompt tokens computed (\d+)", out)]
    assert len(computed) == 2 and computed[1] == int(m.group(2)) * computed[0], computed
    # speculative decoding: every row's greedy output equals plain decoding's, and n-gram guesses are kept
    rows = re.findall(
        r"^(repeats itself|does not repeat)\s+(one at a time|batch)\s+(\S+(?: k=\d+)?)\s.*?(\d+)/(\d+)$",
        out,
        re.M,
    )
    assert len(rows) >= 8, out
    assert all(a == b for *_, a, b in rows), [r for r in rows if r[-2] != r[-1]]
    kept = re.search(r"^repeats itself\s+batch\s+ngram k=4\s+\S+\s+\S+\s+\(\S+\)\s+(\d+)%", out, re.M)
    assert kept and int(kept.group(1)) > 0, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benches on a machine without CUDA")
@pytest.mark.parametrize("name", ["bench_engine.py", "bench_roofline.py"])
def test_a_bench_on_a_missing_gpu_says_so_and_stops(name):
    """``--device cuda`` where torch finds no GPU: the bench says why and exits cleanly, measuring nothing."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"bench_\w+: skipped: device 'cuda' needs .*use device='cpu'\n", proc.stdout), (
        proc.stdout
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [[], ["--cold"]], ids=["warm", "cold"])
def test_bench_attention_quick(flags):
    out = run_bench("bench_attention.py", *flags)
    assert ("--cold: a " in out) == bool(flags), out
    rows = re.findall(
        r"^(small|large) \(.*?\)\s+(\d+)\s+32\s+[\d.]+\s+(?:[\d.]+ \(\s*[\d.]+x\)|-)", out, re.M
    )
    assert sorted(rows) == sorted((shape, b) for shape in ("small", "large") for b in ("1", "4")), out
    assert len(re.findall(r"q_len\s+\d+: torch\s+[\d.]+\s+C\+\+\s+(?:[\d.]+|nan)", out)) == 2, out


@pytest.mark.timeout(300)
def test_bench_linear_quick():
    """Every way runs on 1 and 3 rows (agreeing with F.linear, or the bench stops), the rows mark what
    prepack_weights uses (the kernel at 1 row, oneDNN at 3), and --engine decodes at each batch both ways."""
    from nanolab.model.prepacked import HAS_KERNEL, available

    out = run_bench("bench_linear.py", "--engine")
    assert re.search(r"reading a buffer of that size: [\d.]+ GB/s", out), out
    ways = ["F.linear"] + ["oneDNN"] * available() + ["linear_rows"] * HAS_KERNEL
    for rows in (1, 3):
        line = re.search(rf"^\s+{rows}\s+F\.linear.*$", out, re.M)
        assert line, out
        assert re.findall(r"([\w.]+)\s+[\d.]+ \(\s*[\d.]+x\)", line.group()) == ways, line.group()
        if HAS_KERNEL and available():
            assert re.search(
                r"linear_rows\s+[\d.]+ \(\s*[\d.]+x\) \*"
                if rows == 1
                else r"oneDNN\s+[\d.]+ \(\s*[\d.]+x\) \*",
                line.group(),
            ), line.group()
    assert "every way agrees with F.linear (checked)" in out
    if available():  # the engine's decode with and without prepack_weights, at each batch
        rows = re.findall(
            r"^\s+batch\s+(\d+):\s+[\d.]+\s+[\d.]+\s+[\d.]+x \([\d.]+x to [\d.]+x\)$", out, re.M
        )
        assert rows == ["1", "3"], out


@pytest.mark.timeout(600)
def test_bench_server_quick():
    out = run_bench("bench_server.py")
    equal = re.findall(r"server outputs equal to offline greedy: (\d+)/(\d+)", out)
    assert len(equal) == 2 and all(a == b for a, b in equal), out  # the engine in a process, then a thread
    assert "-- the engine in a process" in out and "-- the engine in a thread" in out
    assert out.count("TTFT") == 2 and out.count("ITL") == 2
    assert out.count("server CPU time per output token") == 2, out
    assert "same concurrency with the engine process's" in out, out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", [[], ["--prepack-weights"]], ids=["F.linear", "prepacked"])
def test_bench_roofline_quick(flags):
    out = run_bench("bench_roofline.py", *flags)
    assert ("oneDNN layouts of the weights, 1-2 rows by linear_rows (prepack_weights)" in out) == bool(
        flags
    ), out
    assert re.search(
        r"limits \(\d+ torch threads\): fp32 matmul [\d.]+ GFLOP/s, memory bandwidth [\d.]+ GB/s", out
    )
    assert re.search(r"decode, batch 1: .* of the measured bandwidth", out), out
    assert re.search(r"decode, batch \d+: .* of the measured matmul peak", out), out
    products = re.search(r"matrix products alone: 8 rows .*, 16 rows .*, 32 rows .*: ([\d.]+)x at most", out)
    assert products and float(products.group(1)) > 0, out
    same = re.search(r"identical outputs (\d+) of (\d+)", out)
    assert same and same.group(1) == same.group(2), (
        out
    )  # the quick model's logits are spread out: no near-ties


def test_bench_tp_quick():
    """The tensor-parallel bench prints both layouts' speed, the communication share and the bytes each
    all-reduce moves, counted and computed (they must agree)."""
    out = run_bench("bench_tp.py")
    assert re.search(r"TP=2 / TP=1: median [\d.]+x", out), out
    assert re.search(r"share of the driver's time in all-reduces: \d+%", out), out
    counted = re.search(r"bytes all-reduced per token: (\d+) \(2 x \d+ layers x \d+ x 4 B = (\d+)\)", out)
    assert counted and counted.group(1) == counted.group(2), out
    same = re.search(r"identical outputs: (\d+)/(\d+)", out)
    assert same and same.group(1) == same.group(2), out
