"""Equivalence harness for sharded data-parallel (FSDP / ZeRO-3) implementations.

Data flow (one direction): options -> scenario matrix -> process worlds -> per-rank
records -> pandas tables -> verdicts -> report / gate.
"""
