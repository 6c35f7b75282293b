"""Build the attention backend a model runs on, by its name in `names.ATTENTION_BACKENDS`.

`model_loader.load_model` calls `create_attention_backend` once per model; the
backend's module is imported only then.
"""

from __future__ import annotations

import importlib

import torch

from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.attention.names import ATTENTION_BACKEND_NAMES, ATTENTION_BACKENDS, AUTO
from arborlm.runtime.layers.attention.triton_backend import triton_usable


def resolve_name(name: str, device: torch.device) -> str:
    """`name`, with "auto" replaced by "triton" on CUDA where Triton runs, else "torch"."""
    if name != AUTO:
        return name
    return "triton" if device.type == "cuda" and triton_usable(device) else "torch"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as `name` (not "auto"), imported now.

    Raises
    ------
    ValueError
        For a name not in `ATTENTION_BACKENDS`.
    """
    target = ATTENTION_BACKENDS.get(name)
    if target is None:
        raise ValueError(f"attention_backend={name!r} is invalid: expected one of {ATTENTION_BACKEND_NAMES}")
    module, _, qualname = target.partition(":")
    return getattr(importlib.import_module(module), qualname)


def create_attention_backend(
    name: str, device: torch.device | str, native: NativeLayerOps | None = None
) -> AttentionBackend:
    """The attention backend called `name` for `device`.

    Parameters
    ----------
    name: one of `ATTENTION_BACKEND_NAMES`: "auto" (Triton on CUDA, torch elsewhere),
        "triton", "torch" or "reference".
    device: where the model runs.
    native: the C++ CPU kernels, which the torch backend uses for DECODE (and, with
        AMX, EXTEND) steps.

    Raises
    ------
    ValueError
        For an unknown name, or "triton" where Triton cannot run (no CUDA and no
        `TRITON_INTERPRET=1`).
    """
    device = torch.device(device)
    return backend_class(resolve_name(name, device)).create(device, native)
