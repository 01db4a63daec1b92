"""What every layer shares: the scenario and its id, the verdict, the bounds and documented
deviations (policy), the machine facts a run records, and the built-in names usage errors check."""
