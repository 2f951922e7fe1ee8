"""The w4a8 kernel core on every instruction set, ARM NEON included: tests/kernel_driver/w4a8_driver.cpp runs the
torch-free core (w4a8_core.cpp, row_ops.h) on inputs written here; it is built natively for each x86 variant
this CPU runs and cross-compiled for aarch64 (Debian's g++-aarch64-linux-gnu) to run under qemu-user
(qemu-aarch64). Every build must give the bits the torch extension gives, and check batch invariance itself, with
4-bit codes (w4a8) and 3-bit ones (w3a8).
The rest of the extension (attention, the fused layer, the torch glue) is compiled for aarch64 against torch's
headers, so an ARM user's first load does not meet a compile error we could have seen here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TESTS
from test_w3a8_linear import three_bit_layer
from test_w4a8_linear import each_variant, layer_and_weight

from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.w4a8_linear import VARIANTS

QUANT = Path(w4a8_linear.__file__).parent
DRIVER = TESTS / "kernel_driver" / "w4a8_driver.cpp"
CROSS_COMPILER, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"
OUT, IN, ROWS = 96, 768, 19  # 6 tiles, 24 groups in 3 blocks; 19 rows: passes of 8 (or 4) and a remainder
# The flags the extension is built with (w4a8_linear.load_variant), without OpenMP: the driver runs one thread.
COMMON_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off"]


def cross_tools_or_skip() -> None:
    """Skips where the aarch64 compiler or qemu-user is missing, except in CI, which installs them (.ci/run):
    there a missing tool fails the test instead of skipping the only ARM check we have."""
    missing = [tool for tool in (CROSS_COMPILER, EMULATOR) if shutil.which(tool) is None]
    if not missing:
        return
    message = f"{', '.join(missing)} missing (Debian: apt install g++-aarch64-linux-gnu qemu-user)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def build(tmp_path: Path, compiler: str, flags: list[str], name: str) -> Path:
    binary = tmp_path / name
    command = [compiler, *COMMON_FLAGS, *flags, f"-I{QUANT}", str(DRIVER), str(QUANT / "w4a8_core.cpp"),
               "-o", str(binary)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return binary


def inputs(tmp_path: Path, bits: int) -> tuple[Path, dict]:
    """The driver's input file for a layer with codes of `bits` bits, and the tensors in it."""
    layer, _ = (layer_and_weight if bits == 4 else three_bit_layer)(OUT, IN, seed=8)
    generator = torch.Generator().manual_seed(9)
    bias = torch.randn(OUT, generator=generator)  # [N]
    x = torch.randn(ROWS, IN, generator=generator) * 3  # [M, K]
    x[0, :32] = 0  # a group of zeros: scale 0, codes 0
    norm_weight = torch.randn(IN, generator=generator)  # [K]
    path = tmp_path / f"input-{bits}.bin"
    with path.open("wb") as file:
        file.write(np.array([OUT, IN, ROWS, bits], dtype=np.int64).tobytes())
        for tensor in (layer.codes, layer.group_scales, layer.block_scales.view(torch.int16), bias, x, norm_weight):
            file.write(tensor.contiguous().numpy().tobytes())
    return path, {"layer": layer, "bias": bias, "x": x, "norm_weight": norm_weight}


def run(binary: Path, input_path: Path, emulator: list[str] | None = None) -> dict:
    """The driver's outputs: matmul [M, N], rms_norm [M, K], silu times up [M, K/2]."""
    output = input_path.with_name(binary.name + ".out")
    done = subprocess.run([*(emulator or []), str(binary), str(input_path), str(output)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # 1: the driver found a row whose bits depend on its batch
    values = torch.from_numpy(np.fromfile(output, dtype=np.float32))
    sizes = {"matmul": (ROWS, OUT), "rms_norm": (ROWS, IN), "silu": (ROWS, IN // 2)}
    parts = values.split([rows * cols for rows, cols in sizes.values()])
    return {name: part.reshape(shape) for (name, shape), part in zip(sizes.items(), parts)}


@pytest.mark.parametrize("isa", [param for param in each_variant() if param.values[0] != "neon"])
def test_the_driver_gives_the_extensions_bits_on_each_x86_variant(tmp_path, isa):
    binary = build(tmp_path, "g++", list(VARIANTS[isa][1]), f"driver-{isa}")
    for bits in (4, 3):
        input_path, given = inputs(tmp_path, bits)
        ours = run(binary, input_path)
        layer = given["layer"]
        extension = w4a8_linear.load_variant(isa).w4a8_mm(given["x"], layer.codes, layer.group_scales,
                                                           layer.block_scales)
        assert torch.equal(ours["matmul"], extension + given["bias"]), bits
    # The row operations against PyTorch: the same math within float32 rounding (bitwise is between variants).
    x = given["x"]
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * given["norm_weight"]
    assert torch.allclose(ours["rms_norm"], normed, rtol=1e-5, atol=1e-5)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(ours["silu"], torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_neon_under_qemu_gives_the_x86_bits(tmp_path):
    cross_tools_or_skip()
    neon_binary = build(tmp_path, CROSS_COMPILER, ["-static", *VARIANTS["neon"][1]], "driver-neon")
    native_isa = w4a8_linear.kernel_isa()
    native_binary = build(tmp_path, "g++", list(VARIANTS[native_isa][1]), f"driver-{native_isa}")
    for bits in (4, 3):
        input_path, _ = inputs(tmp_path, bits)
        neon = run(neon_binary, input_path, emulator=[EMULATOR, "-cpu", "max"])
        native = run(native_binary, input_path)
        for name in ("matmul", "rms_norm", "silu"):
            assert torch.equal(neon[name], native[name]), (bits, name)


def test_the_whole_extension_compiles_for_aarch64():
    cross_tools_or_skip()
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    sources = [str(QUANT / name) for name in w4a8_linear.EXTENSION_SOURCES]  # every file, as load_variant builds
    command = [CROSS_COMPILER, "-fsyntax-only", "-std=c++20", "-ffp-contract=off", "-w", *VARIANTS["neon"][1],
               "-DTORCH_EXTENSION_NAME=specdecode_w4a8_neon", *includes, *sources]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
