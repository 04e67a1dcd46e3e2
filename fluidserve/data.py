"""Where the optional public data files live (traces, GPU profiles, corpus)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path | None:
    """``$FLUIDSERVE_DATA_DIR`` if set (even empty: no data), else ``shared/data`` beside the
    checkout or the cwd; None when there is none."""
    env = os.environ.get("FLUIDSERVE_DATA_DIR")
    repo = Path(__file__).resolve().parents[1]
    candidates = [Path(env)] if env is not None else [
        repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data",
        Path.cwd() / "shared" / "data"]
    return next((p for p in candidates if (p / "traces").is_dir() or (p / "profiles").is_dir()),
                None)
