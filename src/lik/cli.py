"""The ``lik`` command: ``lik demo | index | search | bench | warmup`` (also ``python -m lik.cli``)."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from .demo import run_demo
from .index.commands import add_index_parser, add_search_parser, run_index, run_search

__all__ = ["main", "build_parser"]

# Subcommands implemented elsewhere in the package: name -> (module, function taking the remaining argv).
DELEGATED = {
    "bench": ("lik.bench", "main"),
    "warmup": ("lik.precompile", "main"),
}
DELEGATED_HELP = {
    "bench": "benchmark lik against its peers (arguments go to lik.bench)",
    "warmup": "precompile the kernel variants some shapes need (arguments go to lik.precompile.main)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lik", description="Fused Triton kernels for late-interaction retrieval.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,index,search,bench,warmup}")

    demo = commands.add_parser(
        "demo",
        help="exact top-k MaxSim search over a small real corpus",
        description="Embed a bundled corpus with all-MiniLM-L6-v2 token embeddings, search it with lik.search "
        "and print ranked results with timings. A few default queries always run; add your own as arguments.",
    )
    demo.add_argument("queries", nargs="*", help="extra queries to run after the default ones")
    demo.add_argument("--top-k", type=int, default=5, help="results per query (default 5)")
    demo.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available, else cpu"
    )
    demo.add_argument("--corpus", help="a text file of passages, one per line, instead of the bundled corpus")
    demo.add_argument(
        "--synthetic", action="store_true", help="use deterministic synthetic embeddings instead of the encoder"
    )

    add_index_parser(commands)
    add_search_parser(commands)

    for name, help_text in DELEGATED_HELP.items():
        # Parsed by the delegate itself: listed here for `lik --help` only.
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _delegate(command: str, argv: list[str]) -> int:
    module_name, function_name = DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            print(f"lik {command}: not available in this installation ({module_name} does not exist)", file=sys.stderr)
        else:
            print(f"lik {command}: {module_name} needs {error.name!r}, which is not installed", file=sys.stderr)
        return 1
    entry = getattr(module, function_name, None)
    if entry is None:
        print(f"lik {command}: {module_name} has no {function_name}(argv) entry point", file=sys.stderr)
        return 1
    return int(entry(argv) or 0)


def _run_reporting_errors(command, args, parser) -> int:
    """Run an index command; a bad file or argument ends it with one clear line, not a traceback."""
    try:
        return command(args, parser)
    except (FileNotFoundError, FileExistsError, ValueError, TypeError) as error:
        print(f"lik {args.command}: {error}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse dispatches "demo", "index" and "search": the delegated ones returned above.
    if args.command == "index":
        return _run_reporting_errors(run_index, args, parser)
    if args.command == "search":
        return _run_reporting_errors(run_search, args, parser)
    if args.top_k < 1:
        parser.error(f"--top-k must be at least 1, got {args.top_k}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    return run_demo(
        args.queries, top_k=args.top_k, device=args.device, synthetic=args.synthetic, corpus_path=args.corpus
    )


if __name__ == "__main__":
    sys.exit(main())
