"""The `nanolab` command line: info, generate, bench (and grade, gradescope, release, serve)."""

from __future__ import annotations

import argparse
import math
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and one flag per `EngineConfig` field, for every command that builds an engine."""
    from nanolab.engine.config import EngineConfig

    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or bundled model name (default: the bundled model)",
    )
    EngineConfig.add_cli_args(p)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _cmd_info(args: argparse.Namespace) -> int:
    from nanolab import _ext
    from nanolab._version import __version__

    print(f"nanolab {__version__}")
    if _ext.HAS_C:  # the kernels' threads: OpenMP's team (torch's) when built with OpenMP
        threads = getattr(_ext._C, "threading", "std::thread")
        print(f"kernels: cpp (paged attention and prepack_weights' 1-2 row products on {threads} threads)")
    else:
        print(f"kernels: python ({_ext.why_pure})")
    from nanolab.engine.device import describe_cuda

    print(describe_cuda())  # what --device cuda would find
    try:
        from autograder.sandbox import cgroups, isolation
    except ImportError:  # nanolab installed without its grader
        return 0
    # whether `nanolab grade` runs submissions in bubblewrap, and each in a cgroup of its own
    print(f"grading {isolation.status().describe()}")
    print(f"grading {cgroups.status().describe()}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from nanolab.engine.llm import LLM
    from nanolab.model.sampling import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or None,
        )
        llm = LLM.from_cli_args(args)
        if llm.tokenizer is None:
            print(
                "error: this checkpoint has no tokenizer (nanolab_tokenizer.json or tokenizer.json), "
                "so text prompts cannot be encoded",
                file=sys.stderr,
            )
            return 2
        sys.stdout.write(args.prompt)
        final = None
        for out in llm.stream(args.prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            final = out
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    if args.verbose and final is not None:
        m = final.metrics
        print(
            f"[{m.num_output_tokens} tokens, finish_reason={final.outputs[0].finish_reason}, "
            f"ttft {m.ttft * 1e3:.0f} ms]",
            file=sys.stderr,
        )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from nanolab.benchmark import run_benchmark

    try:
        return run_benchmark(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_grade(args: argparse.Namespace) -> int:
    from autograder.grading.cli import run

    return run(args)


def _cmd_gradescope(args: argparse.Namespace) -> int:
    from autograder.gradescope import kit_command

    return kit_command(args)


def _cmd_release(args: argparse.Namespace) -> int:
    from autograder.release import release_command

    return release_command(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from nanolab.serving.server import run_server

    return run_server(args)


ENGINE_COMMANDS = ("generate", "bench", "serve")


def build_parser(engine_args: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``engine_args=False`` leaves out the engine's flags of the commands that
    build an engine (they import torch, which `nanolab grade` does not need)."""
    add_engine = add_engine_args if engine_args else (lambda p: None)
    parser = argparse.ArgumentParser(prog="nanolab", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    info = sub.add_parser(
        "info",
        help="show the version, which kernels (C++ or Python) are in use, whether CUDA is available, and "
        "which grading sandbox is in use",
    )
    info.set_defaults(func=_cmd_info)
    from autograder.grading.cli import add_arguments as add_grade_arguments

    grade = sub.add_parser("grade", help="grade lab notebooks with the hidden tests (nanolab grade -h)")
    add_grade_arguments(grade)
    grade.set_defaults(func=_cmd_grade)

    from autograder.gradescope import add_arguments as add_gradescope_arguments

    gradescope = sub.add_parser(
        "gradescope", help="write a lab's autograder zip for Gradescope (nanolab gradescope -h)"
    )
    add_gradescope_arguments(gradescope)
    gradescope.set_defaults(func=_cmd_gradescope)

    from autograder.release import add_arguments as add_release_arguments

    release = sub.add_parser(
        "release",
        help="write the learner edition: the labs and the package, without answers (nanolab release -h)",
    )
    add_release_arguments(release)
    release.set_defaults(func=_cmd_release)

    gen = sub.add_parser("generate", help="continue a prompt with the model, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens (default: no limit)"
    )
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("-v", "--verbose", action="store_true", help="print token count and timing")
    add_engine(gen)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="measure engine throughput and latency on a synthetic workload")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    bench.add_argument("--output-len", type=int, default=64, help="mean output length in tokens")
    bench.add_argument("--seed", type=int, default=0)
    add_engine(bench)
    bench.set_defaults(func=_cmd_bench)

    serve = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (see nanolab.serving.server)"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its directory)"
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="abort a request still unfinished this long after it arrived; it is answered with the text "
        'so far and finish_reason "timeout" (a request\'s "timeout" field overrides it; default: no limit)',
    )
    serve.add_argument(
        "--max-waiting",
        type=positive_int,
        default=None,
        metavar="N",
        help="refuse new requests with HTTP 503 and a Retry-After header while N requests wait to be "
        "admitted, instead of queueing them (default: no limit)",
    )
    serve.add_argument(
        "--engine-in",
        choices=["process", "thread"],
        default="process",
        help="where the engine runs: a process of its own (default: HTTP and the engine do not share "
        "Python's GIL) or a thread of the server's process",
    )
    serve.add_argument(
        "--engine-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads of the engine's process (default: one fewer than the cores, at least 1, leaving "
        "the HTTP front end a core; OMP_NUM_THREADS, where set, is taken as it is)",
    )
    add_engine(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(engine_args=command in ENGINE_COMMANDS)
    args = parser.parse_args(argv)
    if args.version:
        from nanolab._version import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`nanolab generate ... | head`): stop quietly, as other command-line
        # tools do. stdout is pointed at /dev/null so Python's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe


if __name__ == "__main__":
    sys.exit(main())
