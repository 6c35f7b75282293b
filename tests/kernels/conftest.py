"""Fixtures of the kernel tests."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from arborlm.kernels import cpu_ops
from arborlm.kernels.cpu_ops import NativeLayerOps


@pytest.fixture(scope="module")
def compiler() -> str:
    """The C++ compiler `build_library` would use; the test is skipped without one."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if found is None:
        pytest.skip("no C++ compiler (g++ or $CXX) to build the native CPU kernels; the torch ops are tested instead")
    return found


@pytest.fixture(scope="module")
def native_lib(compiler, tmp_path_factory) -> ctypes.CDLL:
    """The kernel library as `layer_ops` builds it, once per module.

    Skipped without a compiler; with one, a `KernelBuildError` (the source does not
    compile, an ABI mismatch) fails the tests rather than hiding them."""
    return cpu_ops.load_library(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(scope="module")
def amx_ops(native_lib) -> NativeLayerOps:
    """The native ops on a CPU with AMX; skipped (saying what runs instead) elsewhere."""
    native = NativeLayerOps(native_lib)
    if not native.amx:
        pytest.skip("no AMX on this CPU or compiler: linear layers take oneDNN and extend steps torch's SDPA, "
                    "tested in test_cpu_ops and test_torch_native")
    return native
