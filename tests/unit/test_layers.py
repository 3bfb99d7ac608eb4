"""The import layers of DESIGN.md hold, and `import dapo_mcore` stays light."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("megatron", "transformer_engine", "vllm", "sglang")


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_package_and_its_pure_layers_loads_no_heavy_package():
    code = (
        "import sys, dapo_mcore, dapo_mcore.config, dapo_mcore.algo.losses, dapo_mcore.rewards.dapo_rule, "
        "dapo_mcore.data.datasets, dapo_mcore.parallel, dapo_mcore.cli; "
        f"print([m for m in sys.modules if m.split('.')[0] in {HEAVY!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
