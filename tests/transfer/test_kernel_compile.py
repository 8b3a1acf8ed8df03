"""Compile every kernel for sm_90 without the simulator (the simulator does no type
checking, so a kernel that runs there may not compile for a GPU).

CI: ``pip install 'cuda-toolkit[nvvm,nvrtc]==13.*'`` then
``NUMBA_ENABLE_CUDASIM=0 python -m pytest -m kernelcompile tests/transfer/test_kernel_compile.py``.
No GPU is needed (``cuda.compile_ptx`` only needs NVVM and NVRTC)."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = pytest.mark.kernelcompile


def _skip_reason() -> str | None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM=1: compile_ptx needs the real CUDA target (run with NUMBA_ENABLE_CUDASIM=0)"
    import numba

    if numba.config.ENABLE_CUDASIM:
        return "numba was imported with the CUDA simulator on in this process"
    try:
        from cuda import pathfinder
    except ImportError:
        return "cuda-pathfinder (a numba-cuda dependency) is not installed"
    for lib in ("nvvm", "nvrtc"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception as e:
            return f"lib{lib} not found ({type(e).__name__}): pip install 'cuda-toolkit[nvvm,nvrtc]==13.*'"
    return None


def _kernels() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    reason = _skip_reason()
    if reason:
        return {}
    from kvtier.transfer import kernels

    return kernels.kernel_signatures()


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
@pytest.mark.parametrize("name", sorted(_kernels()) or ["copy_runs"])
def test_kernel_compiles_for_sm90(name: str) -> None:
    from numba import cuda

    pyfunc, sig, opts = _kernels()[name]
    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(9, 0), **opts)
    assert ".target sm_90" in ptx
    if name == "copy_runs":
        # the 16-byte path really issues 16-byte accesses, four loads before the stores
        assert ptx.count("ld.global.v4.u32") >= 4 and ptx.count("st.global.v4.u32") >= 4
        assert ".maxntid 1024" in ptx
