"""Environment variables, read once at import: every one has the `ARBORLM_` prefix.

Code reads `envs.ENVS.<name>` instead of `os.environ`, so the set of knobs that
live outside `ServerArgs` is listed in one place. The API keys are the exception:
they are `ServerArgs` fields, and the variables are how `arborlm serve` takes
them without putting them on its command line (which `ps` shows to every user).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Envs:
    """Settings taken from the environment.

    cache_dir: `ARBORLM_CACHE`, where converted checkpoints live
        (default `~/.cache/arborlm`).
    api_key: `ARBORLM_API_KEY`, the server's `--api-key` when that option
        (and `--api-key-file`) is not given: unlike an option, it does not
        show in `ps`. Empty counts as unset.
    admin_api_key: `ARBORLM_ADMIN_API_KEY`, likewise for `--admin-api-key`.
    test_hang_after_steps: `ARBORLM_TEST_HANG_AFTER_STEPS`, tests only: the
        scheduler's loop hangs for good in the step after this many (the watchdog's
        end-to-end test); unset or empty, never.

    Raises
    ------
    ValueError: `ARBORLM_TEST_HANG_AFTER_STEPS` is not a non-negative integer.
    """

    cache_dir: Path
    # repr=False: printing the settings must not print the keys.
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    test_hang_after_steps: int | None = None

    @classmethod
    def from_environ(cls, environ: os._Environ[str] | dict[str, str] = os.environ) -> Envs:
        """The settings of `environ` (the process environment by default)."""
        cache = environ.get("ARBORLM_CACHE") or os.path.join("~", ".cache", "arborlm")
        return cls(cache_dir=Path(cache).expanduser(), api_key=environ.get("ARBORLM_API_KEY") or None,
                   admin_api_key=environ.get("ARBORLM_ADMIN_API_KEY") or None,
                   test_hang_after_steps=_count(environ, "ARBORLM_TEST_HANG_AFTER_STEPS"))


def _count(environ: os._Environ[str] | dict[str, str], name: str) -> int | None:
    """The non-negative integer in `environ[name]`; None when unset or empty.

    Raises
    ------
    ValueError: the value is not a non-negative integer.
    """
    value = environ.get(name) or None
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r} is invalid: expected a non-negative integer")
    return int(value)


ENVS = Envs.from_environ()
