"""Mutation testing of the harness: injectable faults over fsdp_impl that its checks must catch.

``catalog`` lists the mutants (``CATALOGUE``) and the controls; the mutants are defined in one
``*_mutants`` module per kind of fault, on the injection helpers of ``injection``. ``score`` runs
them all in one matrix and writes ``reports/mutation_score.md``. Nothing here is imported by
``harness`` or ``fsdp_impl``.
"""
