"""Every native kernel library compiles for x86 CPUs other than the one running the tests.

The libraries are built with `-march=native` on the machine that serves, so the
AVX-512 and AMX branches are compiled only on CPUs that have them: a test run on an
AVX2-only machine never sees those branches, and a mistake in them (two structs of one
name, as `cpu_kernels.cpp` once had) would fail only on the first AMX server, where the
kernels would then be missing. Each library's sources are checked here for the main
x86 targets with `-fsyntax-only` (every template the sources instantiate is checked
too; nothing is run: this machine may lack the instructions).
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from arborlm.kernels import cpu_ops, cpu_sampling, fused_decoder_layer, linear_avx512, quant_ops

# gcc's names: AVX-512 + AMX + BF16 (Sapphire Rapids), AVX-512 without BF16 (Skylake-X),
# AVX-512 with BF16 and VNNI but no AMX (Zen 4), AVX2 + FMA (Haswell), SSE2 only.
TARGETS = ["sapphirerapids", "skylake-avx512", "znver4", "haswell", "x86-64"]
LIBRARIES = {
    "cpu_kernels": (cpu_ops.SOURCE,),
    "fused_decoder_layer": fused_decoder_layer.SOURCES,
    "linear_avx512": linear_avx512.SOURCES,
    "quant_kernels": quant_ops.SOURCES,
    "sampling": cpu_sampling.SOURCES,
}

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason=f"the -march targets checked are x86 CPUs; on {platform.machine()} the kernels build only with "
           "-march=native, which the other kernel tests compile and run")


@pytest.mark.parametrize("library", list(LIBRARIES))
@pytest.mark.parametrize("march", TARGETS)
def test_sources_compile_for(march, library, compiler):
    flags = [f for f in cpu_ops.CXX_FLAGS if f not in ("-march=native", "-shared", "-fPIC", "-O3")]
    probe = subprocess.run([compiler, f"-march={march}", "-x", "c++", "-fsyntax-only", "-"], input="",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{compiler} is older than -march={march} (gcc 12.2 has no znver4): no build for that CPU "
                    "can be made with it, so there is nothing to check")
    cpp = [str(src) for src in LIBRARIES[library] if src.suffix == ".cpp"]
    done = subprocess.run([compiler, *flags, f"-march={march}", "-fsyntax-only", *cpp], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
