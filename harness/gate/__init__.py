"""The regression gate: the tolerances per field and the --gate spec (tolerance), baseline files kept
per machine kind (baseline), whether a run's machine matches its baseline's (machine), and the one
comparison against a baseline with its two views, the gate's verdicts and the compare table (compare)."""
