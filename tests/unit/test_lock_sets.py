"""The tested sets' locks (requirements/<set>.txt, dapo_mcore/utils/install.py): each resolves as one environment
for Linux x86_64 and Python 3.12 from its documented install line, against the package index (uv pip compile, a few
seconds each from uv's cache), and the install line is the same everywhere the project names one."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dapo_mcore.utils.install import RECOMMENDED, SETS, install_hint
from tests.conftest import REPO
from tools import lock_sets

KEY_PACKAGES = ("torch", "vllm", "sglang", "megatron-core", "transformer-engine")


def locked(path) -> dict[str, str]:
    return dict(line.split("==", 1) for line in lock_sets.pins(path) if "==" in line and ";" not in line)


@pytest.mark.parametrize("name", [s.name for s in SETS])
def test_each_lock_resolves_from_its_documented_line(name):
    done = subprocess.run([sys.executable, "tools/lock_sets.py", "--check", name], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if done.returncode == lock_sets.UNREACHABLE_EXIT:
        pytest.skip(f"the package index cannot be reached: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("name", [s.name for s in SETS])
def test_each_lock_holds_what_its_input_pins(name):
    """requirements/<set>.in names the torch, the engine, megatron-core and TE; the lock holds exactly those."""
    wanted = {}
    for line in (REPO / "requirements" / f"{name}.in").read_text().splitlines():
        if line and not line.startswith("#"):
            package, version = line.split("==")
            wanted[re.sub(r"\[.*\]", "", package)] = version
    pinned = locked(REPO / "requirements" / f"{name}.txt")
    assert {p: pinned.get(p) for p in wanted} == wanted
    assert set(wanted) | {"transformer-engine-torch"} <= set(pinned)


def test_a_lock_that_does_not_resolve_is_caught(tmp_path):
    """TE 2.20.2 beside vLLM 0.26.0 (the pairing docs/gpu.md gave): its cuDNN frontend needs what vLLM pins lower."""
    bad = tmp_path / "bad.txt"
    text = (REPO / RECOMMENDED.lock).read_text()
    bad.write_text(text.replace("transformer-engine==2.19.0", "transformer-engine==2.20.2")
                   .replace("transformer-engine-torch==2.19.0", "transformer-engine-torch==2.20.2"))  # fmt: skip
    with pytest.raises(SystemExit) as ended:
        lock_sets.check(RECOMMENDED, bad)
    if ended.value.code == lock_sets.UNREACHABLE_EXIT:
        pytest.skip("the package index cannot be reached")
    assert ended.value.code == 1


def test_one_install_line_per_set_wherever_one_is_named():
    """The README, docs/gpu.md, docs/engines.md, the Makefile, docker/Dockerfile and the code's hints name the sets'
    lines; no other route installs the GPU packages."""
    where = ["README.md", "docs/gpu.md", "docs/engines.md", "Makefile", "docker/Dockerfile"]
    texts = {name: (REPO / name).read_text() for name in where}
    assert RECOMMENDED.lines()[0] in texts["README.md"] and RECOMMENDED.lines()[0] in texts["Makefile"]
    for s in SETS:
        assert all(line in texts["docs/gpu.md"] for line in s.lines()), s.name
    for s in SETS:  # the Dockerfile's lines, at each SET (its engine read from the set's name)
        built = texts["docker/Dockerfile"].replace("$SET", s.name).replace('".[$ENGINE]"', f"'.[{s.engine}]'")
        assert all(line in built for line in s.lines()), s.name
    untested = re.compile(r"pip install[^\n`]*(dapo-mcore\[|'\.\[(gpu|vllm|sglang)|\.\[gpu,vllm\])")
    for name, text in texts.items():
        for line in text.splitlines():
            if untested.search(line):
                assert "-c requirements/" in line, f"{name}: {line.strip()}"
    assert install_hint("vllm").startswith(RECOMMENDED.lines()[0])
