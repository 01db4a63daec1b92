"""The markdown report (markdown) and its plots (plots)."""
