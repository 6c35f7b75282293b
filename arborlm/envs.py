"""Environment variables, read once at import: every one has the `ARBORLM_` prefix.

Code reads `envs.ENVS.<name>` instead of `os.environ`, so the set of knobs that
live outside `ServerArgs` is listed in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Envs:
    """Settings taken from the environment.

    cache_dir: `ARBORLM_CACHE`, where converted checkpoints live
        (default `~/.cache/arborlm`).
    """

    cache_dir: Path

    @classmethod
    def from_environ(cls, environ: os._Environ[str] | dict[str, str] = os.environ) -> Envs:
        cache = environ.get("ARBORLM_CACHE") or os.path.join("~", ".cache", "arborlm")
        return cls(cache_dir=Path(cache).expanduser())


ENVS = Envs.from_environ()
