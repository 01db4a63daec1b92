"""Pure checks over the tables: correctness (numeric) and efficiency (resources), each a list of verdicts."""
