"""Fault-injection suite: ranks that raise, die, hang or produce NaN; bad input; Ctrl-C; torchrun."""
