"""The offline vLLM bundle: vLLM's wheel trimmed by name, parts under their bound, parts checked before unpacking."""

import os
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu import bundle

EXECUTABLE = 0o755 << 16


def make_wheel(path: Path, files: dict[str, bytes], executable: set[str] = frozenset()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = EXECUTABLE if name in executable else 0o644 << 16
            z.writestr(info, data)
    return path


def fake_vllm(tmp_path: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A wheel laid out like vLLM's: Python, the kept kernels, and one file under each kind of drop rule."""
    compiled = [
        *bundle.VLLM_KEEP,
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/_flashmla_C.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/_C_extension.abi3.so",
    ]
    files = {name: b"\x7fELF" + name.encode() for name in compiled}
    files |= {
        "vllm/__init__.py": b"",
        "vllm/vllm_flash_attn/__init__.py": b"",
        "vllm/utils/numa_wrapper.sh": b"#!/bin/sh\n",
        "vllm/model_executor/layers/fused_moe/configs/E=8.json": b"{}",
        "vllm/third_party/deep_gemm/__init__.py": b"",
        "vllm/third_party/fmha_sm100/cutlass/include/cute/tensor.hpp": b"//",
        "vllm-0.32.0.dist-info/METADATA": b"Name: vllm\n",
        "vllm-0.32.0.data/scripts/vllm": b"#!python\n",
        **(extra or {}),
    }
    return make_wheel(
        tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        files,
        executable={*compiled, "vllm/utils/numa_wrapper.sh", "vllm-0.32.0.data/scripts/vllm"},
    )


def test_the_trim_keeps_python_data_and_the_named_kernels_and_drops_the_rest(tmp_path):
    members, elsewhere = bundle.wheel_members(fake_vllm(tmp_path))
    kept, dropped = bundle.trim_vllm(members)

    assert {m.path for m in kept} == {
        *bundle.VLLM_KEEP,
        "vllm/__init__.py",
        "vllm/vllm_flash_attn/__init__.py",
        "vllm/utils/numa_wrapper.sh",
        "vllm/model_executor/layers/fused_moe/configs/E=8.json",
        "vllm-0.32.0.dist-info/METADATA",
    }
    assert {d.rule: d.files for d in dropped} == {
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": 1,
        "vllm/_moe_C_stable_libtorch.abi3.so": 1,
        "vllm/_flashmla_C.abi3.so": 1,
        "vllm/vllm-rs": 1,
        "vllm/third_party/deep_gemm/": 2,
        "vllm/third_party/fmha_sm100/": 1,
    }
    assert elsewhere == ["vllm-0.32.0.data/scripts/vllm"]


def test_a_compiled_file_neither_kept_nor_dropped_stops_the_build(tmp_path):
    members, _ = bundle.wheel_members(fake_vllm(tmp_path, {"vllm/_new_C.abi3.so": b"\x7fELF"}))
    with pytest.raises(bundle.BundleError, match="vllm/_new_C.abi3.so"):
        bundle.trim_vllm(members)


def test_a_wheel_without_a_kept_kernel_stops_the_build(tmp_path):
    members, _ = bundle.wheel_members(fake_vllm(tmp_path))
    with pytest.raises(bundle.BundleError, match="_vllm_fa3_C"):
        bundle.trim_vllm([m for m in members if "fa3" not in m.path])


def test_purelib_and_platlib_land_at_the_top_and_other_wheel_data_is_left_out():
    assert bundle.site_path("pkg-1.0.data/purelib/pkg/a.py") == "pkg/a.py"
    assert bundle.site_path("pkg-1.0.data/platlib/pkg/b.so") == "pkg/b.so"
    assert bundle.site_path("pkg-1.0.data/headers/pkg.h") is None
    assert bundle.site_path("pkg/c.py") == "pkg/c.py"


def test_the_plan_uses_the_fewest_parts_within_their_capacity_and_evens_them_out():
    sizes = {"c": 50, "fa3": 12, "py": 8, "deps": 30, "small": 3}
    plan = bundle.plan_parts(sizes, capacity=60)
    assert sorted(n for part in plan for n in part) == sorted(sizes)
    assert sorted(sum(sizes[n] for n in part) for part in plan) == [50, 53]
    assert bundle.plan_parts({"a": 20, "b": 30}, capacity=60) == [["b", "a"]]
    with pytest.raises(bundle.BundleError, match="does not fit 2 parts"):
        bundle.plan_parts({"a": 50, "b": 50, "c": 50}, capacity=60)
    with pytest.raises(bundle.BundleError, match="big alone"):
        bundle.plan_parts({"big": 61}, capacity=60)


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Two parts of a wheel of four incompressible 40 KB files, under a 100 KB bound."""
    monkeypatch.setattr(bundle, "ALONE", 30_000)
    files = {f"pkg/blob{i}.bin": os.urandom(40_000) for i in range(4)} | {"pkg/__init__.py": b"X = 1\n"}
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", files)
    members, _ = bundle.wheel_members(wheel)
    packed = [bundle.pack_unit(unit) for unit in bundle.split_units("pkg==1.0", wheel, members)]
    out = tmp_path / "parts"
    out.mkdir()
    written = bundle.write_parts(packed, out, bound=100_000)
    return out, written, files


def test_each_part_stays_under_the_bound_and_both_unpack_into_the_target(parts, tmp_path, capsys):
    out, written, files = parts
    assert len(written) == 2
    assert all((out / p["file"]).stat().st_size <= 100_000 for p in written)

    target = tmp_path / "site"
    assert bundle.unpack(out, target, complete=True) == 0
    for name, data in files.items():
        assert (target / name).read_bytes() == data
    assert f"export PYTHONPATH={target}" in capsys.readouterr().out


def test_one_part_per_call_unpacks_idempotently(parts, tmp_path, capsys):
    out, written, files = parts
    second = out / written[1]["file"]
    held = second.rename(tmp_path / second.name)
    target = tmp_path / "site"

    assert bundle.unpack(out, target) == 0
    assert bundle.unpack(out, target, complete=True) == 3
    assert f"incomplete: {second.name}" in capsys.readouterr().out

    held.rename(second)
    (out / written[0]["file"]).unlink()
    assert bundle.unpack(out, target, complete=True) == 0
    printed = capsys.readouterr().out
    assert f"{written[0]['file']}: already unpacked" in printed and "complete: all 2 parts" in printed
    assert all((target / name).read_bytes() == data for name, data in files.items())


def test_a_corrupt_part_is_named_and_nothing_of_it_is_unpacked(parts, tmp_path):
    out, written, _ = parts
    part = out / written[1]["file"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))

    target = tmp_path / "site"
    with pytest.raises(bundle.BundleError, match=f"{part.name} is corrupt"):
        bundle.unpack(out, target)
    assert not (target / bundle.DONE_DIR / part.name).exists()


def test_missing_sums_are_a_clear_error(tmp_path):
    with pytest.raises(bundle.BundleError, match="SHA256SUMS is missing"):
        bundle.unpack(tmp_path, tmp_path / "site")
