"""Where the read-only shared data lives (JSONSchemaBench schemas).

`$ARBORLM_SHARED_DATA` wins; else a `shared/data` folder beside the checkout or
above it; else `/work/shared/data`. Tests that need it skip, saying so, when
none exists.
"""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path | None:
    candidates = []
    if os.environ.get("ARBORLM_SHARED_DATA"):
        candidates.append(Path(os.environ["ARBORLM_SHARED_DATA"]))
    root = Path(__file__).resolve().parents[1]
    candidates += [p / "shared" / "data" for p in root.parents] + [Path("/work/shared/data")]
    # A folder counts only if it holds the data (a stray empty `shared/data` must not win).
    return next((p for p in candidates if any((p / "jsonschemabench").glob("*.jsonl"))), None)


def jsonschemabench_dir() -> Path | None:
    base = shared_data_dir()
    return None if base is None else base / "jsonschemabench"
