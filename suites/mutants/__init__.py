"""Mutation testing of the harness: injectable faults over fsdp_impl that its checks must catch.

``catalog`` holds the mutant adapters and ``CATALOGUE``; ``score`` runs them all in one matrix and
writes ``reports/mutation_score.md``. Nothing here is imported by ``harness`` or ``fsdp_impl``.
"""
