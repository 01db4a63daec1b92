"""The memory planner behind `python -m harness plan`: per-rank state at world sizes far beyond this machine, in one
process with torch's fake process group (memory.py), tabled by implementation name (table.py)."""
