"""benchmarks/probe_offline.py: the chunk kernels compiled for sm_90 without a GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import probe_offline


def _run(*args: str) -> subprocess.CompletedProcess:
    """The probe in a process of its own, without the interpreter (the tests run under it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_offline.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_loop_mix_takes_the_longest_backward_branch():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;
        /*0020*/               @P0 LDG.E R3, desc[UR4][R2.64] ;
        /*0030*/                   FMUL R4, R3, R3 ;
        /*0040*/              @!P1 BRA 0x10 ;
        /*0050*/                   EXIT ;
    """
    n, mix = probe_offline.loop_mix(sass)
    assert n == 4 and mix == {"IADD3": 1, "LDG": 1, "FMUL": 1, "BRA": 1}


def test_default_compiles_for_sm90_offline():
    out = _run()
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if " regs " in ln]
    names = [ln.split()[0] for ln in lines]
    # the o3 16x16 default's phi_pass: phi(K) from the token-parallel phi kernel first
    assert names == ["materialise_phi_kernel", "chunk_prepare_kernel", "chunk_split_state_kernel",
                     "chunk_split_output_kernel"]
    # each kernel compiled as its launch would be: aligned pointers specialised (tt.divisibility)
    assert all(int(re.search(r"aligned args +(\d+)", ln).group(1)) > 0 for ln in lines)
    state = lines[2]
    assert 0 < int(re.search(r"regs +(\d+)", state).group(1)) <= 255
    assert int(re.search(r"loop +(\d+) instructions", state).group(1)) > 100  # the chunk loop was found


def test_bad_field_is_a_usage_error():
    out = _run("--set", "no_such_field=1")
    assert out.returncode == 2 and "no_such_field" in out.stderr


def test_wrongly_typed_value_is_a_usage_error():
    """--set tma=False is the string "False" (JSON spells it false): refused, not taken as true."""
    out = _run("--set", "tma=False")
    assert out.returncode == 2 and "tma" in out.stderr and "expected bool" in out.stderr


def test_decode_kernel_compiles_for_sm90_offline():
    """--decode B: the decode step's one launch (state cache of B slots, int32 indices), as
    running_tensor_decode_ makes it; a config field changes what compiles."""
    outs = [_run("--decode", "32"), _run("--decode", "32", "--set", "block_v=16")]
    regs = []
    for out in outs:
        assert out.returncode == 0, out.stderr[-2000:]
        (line,) = [ln for ln in out.stdout.splitlines() if " regs " in ln]
        assert line.split()[0] == "fused_recurrent_running_tensor_fwd_kernel"
        regs.append(int(re.search(r"regs +(\d+)", line).group(1)))
    assert 0 < regs[1] < regs[0] <= 255  # a [K, 16] slab holds half the registers of [K, 32]
    bad = _run("--decode", "0")
    assert bad.returncode == 2 and "--decode" in bad.stderr


def test_probe_dump_writes_each_kernels_code(tmp_path):
    """PROBE_DUMP=DIR: each compiled kernel's TTGIR, PTX and SASS, to read the loop's layouts;
    --decode 256 compiles the batch's tile (64 value columns, 8 warps at H8)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_offline.py"), "--decode", "256"],
                         env={**env, "PROBE_DUMP": str(tmp_path)}, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "block_v=64, num_warps=8" in out.stdout
    name = "fused_recurrent_running_tensor_fwd_kernel"
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"{name}.{ext}" for ext in ("ptx", "sass", "ttgir")]
    assert "tt.func" in (tmp_path / f"{name}.ttgir").read_text()
    assert ".entry" in (tmp_path / f"{name}.ptx").read_text()


def test_config_replaces_the_default_form():
    """--config: a whole config of another form (here the streamed one) is what compiles;
    malformed JSON and a form of the other kernel are usage errors."""
    out = _run("--config", '{"form": "streamed", "chunk_size": 32, "block_k": 64, "block_v": 32}')
    assert out.returncode == 0, out.stderr[-2000:]
    names = [ln.split()[0] for ln in out.stdout.splitlines() if " regs " in ln]
    assert names and "chunk_split_state_kernel" not in names and any("streamed" in n for n in names), names
    for bad in ('{"form": "split", ', '{"form": "recurrent", "block_v": 16}'):
        out = _run("--config", bad)
        assert out.returncode == 2 and "--config" in out.stderr, out.stderr[-500:]
