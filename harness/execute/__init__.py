"""Running scenarios on rank processes: reused forkserver worlds (world, worker), torchrun's
processes (torchrun), and the executor that runs a matrix in them and hands back tables and verdicts."""
