"""Copy a Hugging Face checkpoint's weights into one of our models.

Our models fuse projections the checkpoint stores apart (q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`, as SGLang does); `load_stacked_weights` maps each
checkpoint name to our parameter and the rows of its shard (from the
`MergedLinear` that owns it), checks every shape, reports what is missing, and
prepacks the linears for the CPU kernels. A model's `load_weights` calls it with
its name table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.runtime.layers.linear import MergedLinear, pack_linears

# Checkpoint projection name -> (our fused module name, shard id), e.g. "q_proj" -> ("qkv_proj", "q").
StackedParams = Mapping[str, tuple[str, Hashable]]
T = TypeVar("T")


def weight_progress(
    items: Iterable[T], total: int, desc: str, progress: bool | None = None, unit: str = "tensor"
) -> Iterator[T]:
    """`items` with a tqdm progress bar on stderr, one tick per item (a tensor, or `unit`).

    Parameters
    ----------
    items: what is loaded or converted, one at a time.
    total: how many there are (the bar's length).
    desc: the bar's label ("loading weights").
    progress: True shows the bar, False hides it, None shows it only when stderr is a
        terminal and tqdm's own `TQDM_DISABLE` environment variable is not set (a log
        file or a test run stays quiet).
    """
    from tqdm.auto import tqdm

    if progress is None and not sys.stderr.isatty():
        progress = False
    # Without an explicit `disable`, tqdm reads TQDM_DISABLE (and the other TQDM_* defaults).
    options = {} if progress is None else {"disable": not progress}
    return iter(tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, **options))


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy `(name, tensor)` pairs into `model`'s parameters, then `pack_linears(model)`.

    Parameters
    ----------
    model: parameters named as the checkpoint's, fused projections aside.
    weights: checkpoint names and tensors (any device, the parameter's shape).
    stacked: which checkpoint projections fill which shard of a `MergedLinear`.
    skip: names to ignore (tied heads, rotary buffers).

    Raises
    ------
    ModelLoadError
        For an unknown name, a shape mismatch, or a parameter (or shard) left unloaded.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target, rows = _target(model, name, params, stacked)
        tensor = _rank_slice(model, name, target, tensor, stacked)
        dst = params[target].data if rows is None else params[target].data[rows]
        if dst.shape != tensor.shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add(target if rows is None else f"{target}:{rows.start}")
    _check_loaded(model, params, loaded)
    pack_linears(model)


def _target(model: nn.Module, name: str, params: dict, stacked: StackedParams) -> tuple[str, slice | None]:
    """Our parameter for a checkpoint weight name, and the rows it fills (None = all)."""
    for hf_part, (ours, shard) in stacked.items():
        if f".{hf_part}." in name:
            target = name.replace(hf_part, ours)
            if target in params:
                return target, _owner(model, target).shard_rows(shard)
    if name in params:
        return name, None
    raise ModelLoadError(f"unexpected weight {name!r} in the checkpoint")


def _rank_slice(model: nn.Module, name: str, target: str, tensor: torch.Tensor,
                stacked: StackedParams) -> torch.Tensor:
    """The part of checkpoint tensor `name` that our parameter `target` holds on this rank: the
    owning layer's `checkpoint_slice` (tensor-parallel layers keep their rows or columns), else all."""
    owner = _owner(model, target)
    if not hasattr(owner, "checkpoint_slice"):
        return tensor
    shard = next((s for hf_part, (_, s) in stacked.items() if f".{hf_part}." in name), None)
    return owner.checkpoint_slice(target.rpartition(".")[2], shard, tensor)


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    """The module that holds parameter `param_name` ("a.b.weight" -> model.a.b)."""
    return model.get_submodule(param_name.rpartition(".")[0])


def _check_loaded(model: nn.Module, params: dict, loaded: set[str]) -> None:
    """Raise ModelLoadError naming the parameters (or shards of them) no weight filled."""
    missing = []
    for name in params:
        owner = _owner(model, name)
        if isinstance(owner, MergedLinear):
            if sum(entry.startswith(name + ":") for entry in loaded) != len(owner.shard_slices):
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights for {missing[:5]} ({len(missing)} in all)")
