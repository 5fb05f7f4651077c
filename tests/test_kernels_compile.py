"""The grouped-GEMM kernels compile for the GPU we target (sm_90, H200) in bf16, fp16 and fp32, down to a cubin,
without a GPU: Triton's ahead-of-time compiler with the ptxas its wheel ships. Catches compiled-path breakage
that the interpreter cannot see (it never lowers the kernels). Runs in a subprocess without TRITON_INTERPRET."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lrmoe.kernels import grouped_gemm_triton as g

    def compile_for_h200(kernel, pointer, constexprs):
        params = list(inspect.signature(kernel.fn).parameters)
        sig = {p: ("constexpr" if p in constexprs else pointer if p.endswith("_ptr") else "i32") for p in params}
        sig["offs_ptr"] = "*i32"
        src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]

    for dtype, ieee in [("bf16", False), ("fp16", False), ("fp32", True)]:
        mm = compile_for_h200(g._grouped_mm_kernel, f"*{dtype}", dict(
            BLOCK_E=16, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, EVEN_K=True, UPCAST=False, IEEE=ieee, F64=False))
        dw = compile_for_h200(g._grouped_mm_dw_kernel, f"*{dtype}", dict(
            BLOCK_K=32, BLOCK_N=64, BLOCK_R=32, UPCAST=False, IEEE=ieee, F64=False))
        assert len(mm) > 1000 and len(dw) > 1000
        print(dtype, "ok")
''')


def test_grouped_gemm_kernels_compile_for_sm90(tmp_path):
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["bf16", "ok", "fp16", "ok", "fp32", "ok"]
