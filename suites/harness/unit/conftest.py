"""What the harness's unit tests share: the report tests' stand-in plots (`fast_plots`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.report import plots


@pytest.fixture
def fast_plots(monkeypatch):
    """Stand-in plot functions (drawing real ones is most of a report's time)."""
    for name in ("plot_loss", "plot_diff", "plot_memory"):
        monkeypatch.setattr(plots, name, lambda *args, **_kw: Path(args[-1]).write_bytes(b"stub"))
