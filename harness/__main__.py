"""`python -m harness ...` and the `fsdp-harness` script.

The harness's own process trains nothing (its ranks do, each with one intra-op thread), so it asks for one
thread too, before torch and numpy start their thread pools: a value the user set is kept. A process with a
single thread forks its forkserver in place of starting an interpreter that imports torch again
(harness/execute/forked_server.py); numpy's OpenBLAS alone starts a second thread at import on 2 cores.
"""

import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def main() -> int:
    from harness.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
