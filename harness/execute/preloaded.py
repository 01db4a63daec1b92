"""Imported last by the forkserver, after everything it preloads: moves every object alive now into the
collector's permanent generation (`gc.freeze`), as Python advises before forking workers.

Each forked world worker then starts with nothing for the collector to walk: the first census of a
scenario (harness.measure.census, which lists the tensors alive before it with `gc.get_objects()`, which
does not list frozen objects) no longer walks the hundreds of thousands of objects that importing torch
made, in every worker of every new world; and no collection touches the preloaded objects' pages, which
stay shared with the forkserver. Objects frozen here are the forkserver's own, made before any scenario,
so a census has no business with them either way. Never imported outside the forkserver.

No collection first: the imports leave few unreachable objects, and a full collection over all the objects they
made lies on the path to the first world's start, so to the first progress line (reports/performance.md, "The
first progress line's preload"); frozen, those few stay in the forkserver's memory, shared with its workers.
Python's advice for forking after `gc.freeze` has no collection either.
"""

import gc

gc.freeze()
