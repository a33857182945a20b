"""The ``lik`` command: ``lik demo | index | search | bench | warmup`` (also ``python -m lik.cli``).

Errors: a mistake is one line on stderr, ``lik <command>: error: <file or flag>: <what>``, never a traceback.
Exit status 2 means the command line was refused before any work (a flag's value, a path it names that is
missing or must not be written), 1 that a file could not be used or the work failed. An error that is not a
user's mistake (a bug in lik) is also one line, marked as internal; ``LIK_DEBUG=1`` shows the traceback of any
error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

from .demo import run_demo
from .index.commands import EMBEDDING_LAYOUTS, UsageError, one_line, run_index, run_search
from .index.format import DTYPES
from .index.index import DEFAULT_SHARD_TOKENS
from .index.placement import PLACEMENTS

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
EPILOG = """errors are one line on stderr: `lik <command>: error: <file or flag>: <what>`. Exit status: 0 success,
2 the command line was refused before any work (a flag's value, a path that is missing or must not be
written), 1 a file could not be used or the work failed. LIK_DEBUG=1 shows the traceback of any error.
"""
# Errors that describe the input or the environment (a file, memory, the disk), not a bug in lik.
USER_ERRORS = (ValueError, TypeError, OSError, EOFError, MemoryError, torch.OutOfMemoryError)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors reported by :func:`main` in the one-line format of every other error."""

    def error(self, message):
        error = UsageError(message)
        error.prog = self.prog
        raise error


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lik", description="Fused Triton kernels for late-interaction retrieval.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    demo.add_argument("--corpus", help="a UTF-8 text file of passages, one per line (blank lines and lines "
                      "starting with # are skipped), instead of the bundled corpus")
    demo.add_argument(
        "--synthetic", action="store_true", help="use deterministic synthetic embeddings instead of the encoder"
    )

    _add_index_parser(commands)
    _add_search_parser(commands)

    for name, help_text in DELEGATED_HELP.items():
        # Parsed by the delegate itself: listed here for `lik --help` only.
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _add_index_parser(commands) -> None:
    index = commands.add_parser("index", help="build or inspect a saved lik.Index",
                                description="Build a lik.Index from embedding files, or describe one.",
                                epilog="`lik index build --help` lists the embedding file layouts.")
    actions = index.add_subparsers(dest="index_command", required=True, metavar="{build,info}")
    build = actions.add_parser(
        "build", help="pack embedding files into an index directory", epilog=EMBEDDING_LAYOUTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pack the documents of embedding files, in order, into a new index directory.")
    build.add_argument("embeddings", nargs="+", help=".safetensors / .pt files of document token embeddings")
    build.add_argument("--out", required=True, help="index directory to create")
    build.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="storage dtype (default float16)")
    build.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    build.add_argument("--codec", choices=("exact", "plaid"), default="exact",
                       help="exact tokens (default) or PLAID residual codes (ColBERTv2: centroid + nbits a dimension)")
    build.add_argument("--nbits", type=int, default=None, help="residual bits a dimension for --codec plaid: 1, 2 or 4 "
                       "(default 2)")
    build.add_argument("--num-centroids", type=int, default=None, help="centroids for --codec plaid (default: "
                       "ColBERTv2's rule on the training tokens; any count, a power of two or not)")
    build.add_argument("--train-tokens", type=int, default=None, help="leading tokens the --codec plaid codec is "
                       "trained on (default 1048576)")
    build.add_argument("--rescore-dtype", choices=("int8", "float16"), default=None, help="--codec plaid: also keep "
                       "an exact copy of the tokens in this dtype for rescoring (search(..., rescore=))")
    build.add_argument("--overwrite", action="store_true",
                       help="replace the lik index at --out (anything else there is refused, never deleted)")
    info = actions.add_parser(
        "info", help="describe a saved index (and check it)",
        description="Print a saved index's counts as JSON after loading it, which checks the manifest, the "
        "shard headers and the file sizes; --verify also checks every shard's sha256.")
    info.add_argument("path", help="index directory")
    info.add_argument("--verify", action="store_true", help="check every shard's sha256 (reads every byte)")


def _add_search_parser(commands) -> None:
    search = commands.add_parser(
        "search", help="exact top-k search of a saved index", epilog=EMBEDDING_LAYOUTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Search a saved lik.Index with the queries of an embedding file (each query is one "
        "document of the file: [Lq, d] token embeddings).")
    search.add_argument("index", help="index directory (from `lik index build`)")
    search.add_argument("--queries", required=True, help=".safetensors / .pt file of query token embeddings")
    search.add_argument("--k", type=int, default=10, help="results per query (default 10)")
    search.add_argument("--placement", choices=PLACEMENTS, default="auto", help="where the index lives")
    search.add_argument("--device", default=None, help="scoring device (default: cuda when available, else cpu)")
    search.add_argument("--batch-size", type=int, default=32, help="queries per search call (default 32)")
    search.add_argument("--output", help="save {'scores', 'ids'} to this new .pt file instead of printing them "
                        "(written whole or not at all; never inside the index)")
    search.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def _delegate(command: str, argv: list[str]) -> int:
    module_name, function_name = DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            print(f"lik {command}: error: not available in this installation ({module_name} does not exist)",
                  file=sys.stderr)
        else:
            print(f"lik {command}: error: {module_name} needs {error.name!r}, which is not installed",
                  file=sys.stderr)
        return 1
    entry = getattr(module, function_name, None)
    if entry is None:
        print(f"lik {command}: error: {module_name} has no {function_name}(argv) entry point", file=sys.stderr)
        return 1
    return int(entry(argv) or 0)


def _run_demo(args) -> int:
    if args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {args.top_k}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    if args.corpus is not None and not Path(args.corpus).is_file():
        raise UsageError(f"--corpus {args.corpus}: {'not a file' if Path(args.corpus).exists() else 'no such file'}")
    return run_demo(
        args.queries, top_k=args.top_k, device=args.device, synthetic=args.synthetic, corpus_path=args.corpus
    )


def _command_name(args) -> str:
    if args is None:
        return "lik"
    if args.command == "index":
        return f"lik index {args.index_command}"
    return f"lik {args.command}"


def _describe(error: BaseException) -> str:
    """The one line that reports ``error``: its message, the file an OSError names, or the internal error."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or one_line(str(error))}"
    message = one_line(str(error)) or type(error).__name__
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return f"out of memory ({message})"
    if isinstance(error, USER_ERRORS):
        return message
    return f"internal error ({type(error).__name__}: {message}); LIK_DEBUG=1 shows the traceback, please report it"


def main(argv: list[str] | None = None) -> int:
    """Run the ``lik`` command on ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = None
    try:
        args = build_parser().parse_args(argv)
        if args.command == "index":
            return run_index(args)
        if args.command == "search":
            return run_search(args)
        return _run_demo(args)
    except SystemExit as done:  # --help, or argparse's own exit
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except KeyboardInterrupt:
        print(f"{_command_name(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("LIK_DEBUG", "") not in ("", "0"):
            raise
        print(f"{getattr(error, 'prog', None) or _command_name(args)}: error: {_describe(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
