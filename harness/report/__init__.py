"""The markdown report: render, write and stage it (markdown), its sections (verdicts, results,
resources), the sections other packages register (sections), how it reads the run's tables
(groups) and writes figures and tables (formatting), and its plots (plots)."""
