"""The `nanolab` command line: info, generate and bench on a small checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers.engine_utils import tiny_model

from nanolab import LLM, SamplingParams, Tokenizer
from nanolab.cli import main
from nanolab.model.loading import save_model

TEXT = "def f(x):\n    return x * 2\n\nprint(f(3))\nimport sys\n" * 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = Tokenizer.train(TEXT, 280, special_tokens=["<|endoftext|>"])
    model = tiny_model("llama", seed=9, vocab_size=tok.vocab_size, max_seq_len=256)
    return save_model(model, tmp_path_factory.mktemp("cli"), tok)


def test_info_names_the_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "nanolab" in out and ("cpp" in out or "python" in out)


def test_info_says_whether_cuda_is_available(capsys):
    """``nanolab info`` has a line on CUDA: the GPUs torch sees, or why there are none."""
    import torch

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if torch.cuda.is_available():
        assert re.search(r"^cuda: available, \d+ GPU\(s\): cuda:0 ", out, re.M), out
    else:
        assert re.search(r"^cuda: not available \(.*(no CUDA support|finds no GPU)\)$", out, re.M), out


def test_the_device_flag_reaches_the_config_and_a_bad_one_is_an_error(checkpoint, capsys):
    """``--device`` is an engine flag like the others; a device that is no device, or one this machine
    cannot use, stops the command with the reason and exit status 2, no traceback."""
    from nanolab.cli import build_parser
    from nanolab.engine.config import EngineConfig

    args = build_parser().parse_args(["generate", "x", "--device", "cpu"])
    assert EngineConfig.from_cli_args(args).device == "cpu"
    assert main(["generate", "x", "--model", str(checkpoint), "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "device 'gpu' is not a torch device" in err and "Traceback" not in err
    assert main(["generate", "x", "--device", "cuda", "--attention-backend", "cpp"]) == 2
    assert "runs on the CPU only" in capsys.readouterr().err


def test_generate_streams_the_same_text_as_the_api(checkpoint, capsys):
    assert main(["generate", "def f", "--model", str(checkpoint), "--max-tokens", "10"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(checkpoint)
    expected = llm.generate("def f", SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert printed == "def f" + expected.outputs[0].text + "\n"


def test_generate_reports_bad_arguments_without_a_traceback(checkpoint, capsys):
    assert main(["generate", "x", "--model", str(checkpoint), "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature must be" in err and "Traceback" not in err
    assert main(["generate", "x", "--model", str(checkpoint / "missing")]) == 2


def test_bench_prints_throughput_and_latency(checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "nanolab.cli",
        "bench",
        "--model",
        str(checkpoint),
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "8",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    for needle in ("requests: 6", "output tokens/s", "TTFT", "TPOT", "mean batch size"):
        assert needle in res.stdout
    assert "speculative decoding" not in res.stdout
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    res = subprocess.run(cmd + spec, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.search(
        r"speculative decoding: guesses kept \d+ of \d+ .*model forwards per output token", res.stdout
    )


def test_generate_into_a_closed_pipe_stops_without_a_traceback(checkpoint):
    """`nanolab generate ... | head -c 1`: the reader leaves early; no traceback, the status of a broken pipe."""
    cmd = [sys.executable, "-m", "nanolab.cli", "generate", "def f", "--model", str(checkpoint)]
    proc = subprocess.Popen([*cmd, "--max-tokens", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader is gone: the next write gets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_engine_flags_are_generated_from_engine_config():
    """Every EngineConfig field is a flag with its field comment as help, and the flags build the config."""
    import dataclasses

    from nanolab.cli import build_parser
    from nanolab.engine.config import EngineConfig, SchedulingPolicy

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["generate"]  # the generate subcommand's parser
    helps = {a.dest: a.help for a in sub._actions}
    for f in dataclasses.fields(EngineConfig):
        assert helps.get(f.name), f"--{f.name.replace('_', '-')} has no help text"
    args = parser.parse_args(
        [
            "generate",
            "x",
            "--block-size",
            "4",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.block_size == 4 and not config.enable_prefix_caching
    assert config.scheduling_policy is SchedulingPolicy.PRIORITY
    assert EngineConfig.from_cli_args(parser.parse_args(["generate", "x"])) == EngineConfig()


def test_engine_settings_are_checked_by_name():
    from nanolab.engine.config import EngineConfig

    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
