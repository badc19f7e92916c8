"""model/precision.py: whether this CPU computes in bf16 natively, from torch's own test,
and the settings that make any CPU stand in for an AVX2 one."""
import os
from pathlib import Path

import pytest
import torch

from model import precision


@pytest.mark.parametrize("env,held", [
    ({}, False), ({"ATEN_CPU_CAPABILITY": "avx2"}, True), ({"ATEN_CPU_CAPABILITY": "default"}, True),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, False), ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, True),
    # torch compares the value exactly and ignores any other, with a warning
    ({"ATEN_CPU_CAPABILITY": "AVX2"}, False), ({"ATEN_CPU_CAPABILITY": " avx2"}, False),
    ({"DNNL_MAX_CPU_ISA": "avx2"}, True), ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "ALL", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, False)])
def test_the_avx2_settings_hold_torch_below_avx512(env, held):
    assert precision.held_below_avx512(env) is held


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("env", [{}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}])
def test_native_bf16_is_onednns_answer_unless_torch_is_held_to_avx2(onednn, env, monkeypatch):
    """oneDNN's answer decides (the test ATen makes before it sends a bf16 matmul to
    oneDNN), and either AVX2 setting overrules a yes; bf16 work is then done in fp32."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    precision.cpu_has_native_bf16.cache_clear()
    try:
        native = onednn and not env
        assert precision.cpu_has_native_bf16() is native
        assert precision.cpu_compute_dtype(torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
        assert precision.cpu_compute_dtype(torch.float32) == torch.float32
    finally:
        precision.cpu_has_native_bf16.cache_clear()


def test_the_cpu_kind_names_torchs_kernels_and_bf16(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision.cpu_kind() == "AVX2, no native bf16"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.cpu_kind() == "AVX512, native bf16"


def test_each_cpu_capability_compiles_into_a_cache_of_its_own(tmp_path):
    """torch.compile's cache does not tell kernels built for AVX2 from AVX-512 ones: a
    compiled FlexAttention built under ATEN_CPU_CAPABILITY=avx2 (bench/cpu_kinds.py), loaded
    by a run without it, died of "double free or corruption". Each capability gets a
    folder of its own, the one torch's own cache_dir() then uses."""
    import subprocess
    import sys
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    # torch's default, written out alike; a tail even without the setting, so a cache
    # shared before, which may hold avx2 kernels, is not read again
    assert precision.separate_compile_cache({}) == default_cache_dir() + "-aten-auto"
    assert precision.separate_compile_cache({"ATEN_CPU_CAPABILITY": "avx2"}) == \
        default_cache_dir() + "-aten-avx2"
    given = str(tmp_path / "c")
    for env, expected in [({"TORCHINDUCTOR_CACHE_DIR": given}, given + "-aten-auto"),
                          ({"TORCHINDUCTOR_CACHE_DIR": given, "ATEN_CPU_CAPABILITY": "avx2"}, given + "-aten-avx2"),
                          # a run started from one held to AVX2 inherits its folder
                          ({"TORCHINDUCTOR_CACHE_DIR": given + "-aten-avx2"}, given + "-aten-auto"),
                          ({"TORCHINDUCTOR_CACHE_DIR": given + "-aten-avx2",
                            "ATEN_CPU_CAPABILITY": "avx512"}, given + "-aten-avx512")]:
        assert precision.separate_compile_cache(dict(env)) == expected, env
    # Importing the model is enough, before anything compiles.
    code = ("import model\nfrom torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(cache_dir())")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "TORCHINDUCTOR_CACHE_DIR": given, "ATEN_CPU_CAPABILITY": "avx2"},
                         cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    assert out == given + "-aten-avx2"
