"""`python -m harness ...` and the `fsdp-harness` script.

Ctrl-C is taken over first, before anything else is imported (harness/core/interrupt.py): at any moment from
here on, the first imports included, it ends the process with exit 130 and the one line "interrupted", never
a traceback, never a run that goes on.

The harness's own process trains nothing (its ranks do, each with one intra-op thread), so it asks for one
thread too, before torch and numpy start their thread pools: a value the user set is kept. A process with a
single thread forks its forkserver in place of starting an interpreter that imports torch again
(harness/execute/forked_server.py); numpy's OpenBLAS alone starts a second thread at import on 2 cores.
"""

from harness.core import interrupt

interrupt.install()

import os  # noqa: E402
import sys  # noqa: E402

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def main() -> int:
    """The CLI's exit status; EXIT_INTERRUPTED (said) if a Ctrl-C came at any point, the CLI's import included."""
    try:
        from harness.cli import main as cli

        status = cli()
    except KeyboardInterrupt:
        return interrupt.said()
    except SystemExit as e:  # argparse's own exits (--help, usage errors)
        if interrupt.interrupted():
            return interrupt.said()
        raise e
    return interrupt.finish(status)


if __name__ == "__main__":
    sys.exit(main())
