"""The regression gate: baselines kept per machine kind and the one comparison against them."""
