"""Small multi-rank checks of fsdp_impl, run inside ``harness.execute.world.World`` workers.

Tests call ``world.call("suites.fsdp_impl.worlds.<module>:<task>", payload)``; each task builds a
seeded model on every rank, does its thing, and returns plain data (numpy arrays, floats, strings)
so that nothing but pickles crosses the pipe. The plain (non-sharded) reference runs through the
same tasks with ``wrap=False``, in the same kind of worker (one thread, deterministic algorithms),
so bitwise comparisons compare like with like.

- ``common``: what every task shares (the seeded, sharded model, its batches, full parameters
  as numpy, the padding check);
- ``wrapping``: what fully_shard does to a model (shard layout, shared parameters, buffers);
- ``training``: training steps, sharded or plain (numerics, mixed precision, training modes);
- ``state_dicts_and_meta_init``: full state dicts saved and loaded, meta-device init;
- ``hybrid``: hybrid sharding (R replicas x S shards), its groups and its reduction;
- ``checkpointing``: sharded checkpoints saved at one world size and resumed at another.
"""
