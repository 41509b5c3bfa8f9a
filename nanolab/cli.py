"""The `nanolab` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import nanolab

    print(f"nanolab {nanolab.__version__}")
    print(f"kernels: {nanolab.backend()}" + ("" if nanolab.HAS_C else f" ({nanolab._ext.why_pure})"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanolab", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="show the version and which kernels (C++ or Python) are in use")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import nanolab

        print(nanolab.__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
