"""Per-sample gradient norms (DP-SGD clipping): the rank tasks and float64 truth (tasks), the run
over world sizes and data modes (run), and the report section (section)."""
