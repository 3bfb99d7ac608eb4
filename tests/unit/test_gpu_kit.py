"""The kit that carries vLLM to a GPU machine without network (tools/gpu_wheels.sh --vllm-pack, then
tools/gpu_install.sh vllm-stage and vllm), run for real on a synthetic wheel of a few MB with a cap of 1 MB a
folder: no folder over the cap, the members a Hopper GPU does not load gone, the wheel rebuilt from its chunks equal
to the trimmed one and installed (into a folder, with pip), and a damaged or missing chunk stopping the install
with the failing checksum named. Nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEEL = "vllm-0.0.0-cp38-abi3-manylinux_2_31_x86_64.whl"
CAP = 1_000_000  # DAPO_CHUNK_BYTES: the largest folder a call may carry
NOISE = random.Random(0)
KEPT = {
    "vllm/__init__.py": b"__version__ = '0.0.0'\n",
    "vllm/_C_stable_libtorch.abi3.so": NOISE.randbytes(1_500_000),  # random bytes: zip cannot shrink them
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": NOISE.randbytes(1_000_000),
    "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": NOISE.randbytes(200_000),
}
TRIMMED = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": NOISE.randbytes(1_200_000),
    "vllm/vllm-rs": NOISE.randbytes(300_000),
    **{f"vllm/third_party/deep_gemm/_C.cpython-3{v}-x86_64-linux-gnu.so": NOISE.randbytes(5_000) for v in (10, 11, 13)},
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so": NOISE.randbytes(5_000),
}
DEPS = {"fakedep_a": 600_000, "fakedep_b": 600_000, "fakedep_c": 100_000}  # name -> bytes of payload

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("zip", "unzip", "split", "sha256sum")), reason="needs zip and coreutils"
)


def make_wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = [
        f"{member},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for member, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """A copy of the two scripts in a folder of its own (they work in the folder above tools/), where
    gpu_wheels.sh --vllm-pack has laid out .vllm<N>/ and .vdeps<N>/ from the synthetic wheels."""
    root = tmp_path_factory.mktemp("kit")
    (root / "tools").mkdir()
    for script in ("gpu_wheels.sh", "gpu_install.sh"):
        shutil.copy(REPO / "tools" / script, root / "tools" / script)
    (root / "in" / "deps").mkdir(parents=True)
    make_wheel(root / "in" / WHEEL, "vllm", "0.0.0", KEPT | TRIMMED)
    for name, size in DEPS.items():
        files = {f"{name}/__init__.py": b"", f"{name}/payload.bin": NOISE.randbytes(size)}
        make_wheel(root / "in" / "deps" / f"{name}-1.0-py3-none-any.whl", name, "1.0", files)
    proc = run(str(root / "tools" / "gpu_wheels.sh"), "--vllm-pack", str(root / "in" / WHEEL),
               str(root / "in" / "deps"), env={**os.environ, "DAPO_CHUNK_BYTES": str(CAP)})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (root / "pack.log").write_text(proc.stdout + proc.stderr)
    return root


def staged(kit: Path, where: Path) -> Path:
    """tools/gpu_install.sh vllm-stage, one call per carried folder as on the machine; returns the chunks' folder."""
    env = {**os.environ, "DAPO_VLLM_CHUNKS": str(where)}
    for folder in sorted(kit.glob(".vllm[0-9]*")) + sorted(kit.glob(".vdeps[0-9]*")):
        hidden = [other for other in kit.glob(".v*[0-9]") if other != folder]  # only this one is carried
        for other in hidden:
            other.rename(other.with_name("_" + other.name))
        try:
            proc = run(str(kit / "tools" / "gpu_install.sh"), "vllm-stage", env=env)
        finally:
            for other in hidden:
                other.with_name("_" + other.name).rename(other)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return where


def install(kit: Path, chunks: Path, site: Path) -> subprocess.CompletedProcess:
    """tools/gpu_install.sh vllm, with pip installing into SITE (PIP_TARGET) rather than this Python."""
    env = {**os.environ, "DAPO_VLLM_CHUNKS": str(chunks), "PYTHON": sys.executable, "PIP_TARGET": str(site),
           "PYTHONPATH": str(site)}  # fmt: skip
    return run(str(kit / "tools" / "gpu_install.sh"), "vllm", env=env)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def test_every_folder_is_within_the_cap_and_the_trimmed_members_are_listed_with_their_sizes(kit):
    chunks, deps = sorted(kit.glob(".vllm[0-9]*")), sorted(kit.glob(".vdeps[0-9]*"))
    assert len(chunks) >= 3 and len(deps) == 2, (chunks, deps)
    sizes = {folder.name: folder_bytes(folder) for folder in chunks + deps}
    assert max(sizes.values()) <= CAP, sizes
    parts = sorted(path.name for folder in chunks for path in folder.glob("*.part*"))
    assert parts == sorted(f"{WHEEL}.part{n}" for n in range(1, len(chunks) + 1))
    assert sorted(path.name for folder in deps for path in folder.iterdir()) == sorted(
        f"{name}-1.0-py3-none-any.whl" for name in DEPS
    )
    log = (kit / "pack.log").read_text()
    for member, data in TRIMMED.items():
        assert f"trimmed {member}: {len(data)} bytes" in log
    assert ".vllm1/" in log and ".vdeps2/" in log  # the summary names each folder


def test_the_chunks_rebuild_the_trimmed_wheel_which_installs(kit, tmp_path):
    chunks = staged(kit, tmp_path / "chunks")
    proc = install(kit, chunks, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"vllm 0.0.0 in {tmp_path / 'site' / 'vllm'}" in proc.stdout
    assert f"{WHEEL} and 3 dependency wheels match SHA256SUMS" in proc.stdout

    rebuilt = chunks / WHEEL
    sums = dict(line.split()[::-1] for line in (chunks / "SHA256SUMS").read_text().splitlines())
    assert sha256(rebuilt) == sums[WHEEL]
    assert {f"deps/{name}-1.0-py3-none-any.whl" for name in DEPS} <= sums.keys()
    with zipfile.ZipFile(rebuilt) as wheel:
        assert wheel.testzip() is None
        names = set(wheel.namelist())
        assert not names & TRIMMED.keys()
        assert all(wheel.read(member) == data for member, data in KEPT.items())
        record = wheel.read("vllm-0.0.0.dist-info/RECORD").decode()
    assert not [member for member in TRIMMED if f"{member}," in record]
    assert all(f"{member}," in record for member in KEPT)
    site = tmp_path / "site"
    assert (site / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == KEPT["vllm/_C_stable_libtorch.abi3.so"]
    assert not (site / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so").exists()
    assert all((site / name / "payload.bin").stat().st_size == size for name, size in DEPS.items())


@pytest.mark.parametrize("damage", ["a flipped byte", "a missing chunk"])
def test_a_damaged_or_missing_chunk_stops_the_install_and_names_the_checksum(kit, tmp_path, damage):
    chunks = staged(kit, tmp_path / "chunks")
    part = chunks / f"{WHEEL}.part2"
    if damage == "a flipped byte":
        data = bytearray(part.read_bytes())
        data[1000] ^= 0xFF
        part.write_bytes(bytes(data))
    else:
        part.unlink()
    proc = install(kit, chunks, tmp_path / "site")
    assert proc.returncode == 1
    assert f"sha256 checksums do not match {chunks}/SHA256SUMS" in proc.stdout
    assert f"{WHEEL}.part2: FAILED" in proc.stdout and f"{WHEEL}: FAILED" in proc.stdout
    assert "part1: FAILED" not in proc.stdout
    assert not (tmp_path / "site").exists()  # nothing installed
