"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from arborlm.kernels import cpu_ops
from arborlm.kernels.cpu_ops import NativeLayerOps


@pytest.fixture(scope="module")
def amx_ops(tmp_path_factory) -> NativeLayerOps:
    """The native ops of a library built for the module, on a CPU with AMX.

    Skipped (saying what runs instead) where the library does not build or the CPU
    or compiler has no AMX: there, linear layers take oneDNN and extend steps torch's
    SDPA, both tested elsewhere."""
    try:
        lib = cpu_ops.load_library(tmp_path_factory.mktemp("kernels-amx"))
    except cpu_ops.KernelBuildError as e:
        pytest.skip(f"the native CPU kernels do not build here ({e}); the torch ops are tested instead")
    native = NativeLayerOps(lib)
    if not native.amx:
        pytest.skip("no AMX on this CPU or compiler: linear layers take oneDNN and extend steps torch's SDPA, "
                    "tested in test_cpu_ops and test_torch_native")
    return native
