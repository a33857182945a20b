"""Run the lik benchmark from a source checkout: ``python benchmarks/run.py --suite all --out $OUT``.

A thin wrapper over :func:`lik.bench.main` (the same as ``lik bench`` / ``python -m lik.bench``) that puts
``src/`` on the path, so it also works where the package is not installed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lik.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
