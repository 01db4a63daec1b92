"""Imported last by the forkserver, after everything it preloads: moves every object alive now into the
collector's permanent generation (`gc.freeze`), as Python advises before forking workers.

Each forked world worker then starts with nothing for the collector to walk: the first census of a
scenario (harness.measure.census, which lists the tensors alive before it with `gc.get_objects()`, which
does not list frozen objects) no longer walks the hundreds of thousands of objects that importing torch
made, in every worker of every new world; and no collection touches the preloaded objects' pages, which
stay shared with the forkserver. Objects frozen here are the forkserver's own, made before any scenario,
so a census has no business with them either way. Never imported outside the forkserver.

No collection first: the imports leave a few dozen unreachable objects, and a full collection over the objects
they made takes a sizeable part of a second on the path to the first world's start (so the first progress line);
frozen, those few stay in the forkserver's memory, shared with its workers, as Python's advice for `gc.freeze`
before forking has it (no collection, only the freeze).
"""

import gc

gc.freeze()
