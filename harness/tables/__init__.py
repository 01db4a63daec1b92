"""Per-rank records -> pandas tables (build), and the CSV store the report and the gate read (store)."""
