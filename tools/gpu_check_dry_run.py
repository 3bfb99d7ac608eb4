"""The dry run's checker of tools/gpu_check.sh (DRY_RUN=1): every command the steps recorded, checked on a machine
without a GPU in one process (Megatron and the config schema imported once).

    python tools/gpu_check_dry_run.py TODO_FILE PYTHON GPU_GB     (gpu_check.sh calls it)
"""

import argparse
import contextlib
import importlib.util
import io
import logging
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

todo, python, gpu_gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
# What `check` says of this machine rather than of the step: it has no GPU, and Transformer Engine (and maybe
# vLLM) is carried to the GPU machine only. Routing replay's check resolves the job's device
# (dapo_mcore/build.py check_routing_replay), hence the first on a CPU.
NOT_THE_STEPS = {
    "parallel.device=cuda but no CUDA device is visible": "no CUDA device",
    "transformer_engine is not installed": "no Transformer Engine",
    "needs the 'vllm' package": "no vLLM",
}


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace[0] if isinstance(namespace, tuple) else namespace


def last_line(text, fallback):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else fallback


def parse_only(script, args):
    """SCRIPT's own argument parser on ARGS, stopped once it has accepted them (before the tool does anything):
    (None, namespace), or (why, None)."""
    real = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = 0

    def stopping(method):
        def parse(self, *a, **k):
            nonlocal depth
            depth += 1
            try:
                result = method(self, *a, **k)
            finally:
                depth -= 1
            if depth == 0:  # the tool's own call, not parse_args' inner one or a subparser's
                raise Parsed(result)
            return result

        return parse

    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = map(stopping, real)
    argv, path, err = sys.argv, sys.path[0], io.StringIO()
    sys.argv, sys.path[0] = [script, *args], str(Path(script).resolve().parent)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        return "it parsed no arguments (ran to its end)", None
    except Parsed as parsed:
        return None, parsed.namespace
    except SystemExit as stop:
        return last_line(err.getvalue(), f"exited {stop.code}"), None
    except Exception as e:
        return f"{type(e).__name__}: {e}", None
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real
        sys.argv, sys.path[0] = argv, path


def config_problems(config, overrides, notes):
    """What `dapo-mcore check CONFIG OVERRIDES --gpus 1 --gpu-gb GPU_GB` would list, less this machine's."""
    from dapo_mcore.check import check_run
    from dapo_mcore.config import load_config
    from dapo_mcore.utils.errors import DapoError

    if not Path(config).is_file():
        return [f"missing: {config}"]
    try:
        report = check_run(load_config(config, overrides), 1, gpu_gb)
    except DapoError as e:
        return [str(e)]
    problems = []
    for problem in report.problems:
        machine = [note for text, note in NOT_THE_STEPS.items() if text in problem]
        notes.update(machine)
        problems += [] if machine else [problem]
    return problems


def train_problems(args, notes):
    if len(args) < 2 or args[0] != "train":
        return [f"not `dapo_mcore.cli train CONFIG OVERRIDES...`: {' '.join(args)}"]
    return config_problems(args[1], args[2:], notes)


def torchrun_problems(args, notes):
    from torch.distributed.run import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            launch = parse_args(args)
    except SystemExit:
        return [f"torchrun: {last_line(err.getvalue(), 'refused its arguments')}"]
    if not (launch.module and launch.training_script == "dapo_mcore.cli"):
        return [f"torchrun starts {launch.training_script}, not -m dapo_mcore.cli"]
    return train_problems(launch.training_script_args, notes)


def pytest_problems(args, checked):
    """`python -m pytest ARGS` collected (not run) in a process of its own, as on the GPU machine: a test file
    that does not import, a -k that selects nothing, a missing path fail the step. (Here the GPU tier's tests
    skip without CUDA: collecting them is what can be checked.)"""
    collect = [python, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args]
    done = subprocess.run(collect, capture_output=True, text=True, timeout=120)
    said = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)  # "N tests collected", "N/M ..." with -k
    per_file = re.findall(r"^\S+\.py: (\d+)$", done.stdout, re.M)  # -qq: "FILE: N" a file
    count = int(said.group(1)) if said else sum(map(int, per_file))
    if done.returncode != 0 or not count:
        why = "no test selected" if done.returncode == 5 else last_line(done.stdout + done.stderr, "no output")
        return [f"pytest --collect-only exited {done.returncode}: {why}"]
    checked.append(f"pytest collected {count} tests")
    return []


def command_problems(argv, checked, notes):
    """Why the recorded command would fail before doing its work; what was checked goes into `checked`."""
    if argv[0] != python:  # nvidia-smi and the like: nothing to check without the GPU
        checked.append("not checked: " + argv[0])
        return []
    if len(argv) < 2 or (argv[1] in ("-c", "-m") and len(argv) < 3):
        return [f"an incomplete command: {' '.join(argv)}"]
    if argv[1] == "-c":
        checked.append("python snippet compiled")
        try:
            compile(argv[2], "<python -c>", "exec")
        except SyntaxError as e:
            return [f"python -c: {e}"]
        return []
    if argv[1] == "-m":
        module, args = argv[2], argv[3:]
        if module == "torch.distributed.run":
            checked.append("DAPO run checked")
            return torchrun_problems(args, notes)
        if module == "dapo_mcore.cli":
            checked.append("DAPO run checked")
            return train_problems(args, notes)
        if module == "pytest":
            return pytest_problems(args, checked)
        checked.append(f"module {module} found")
        return [] if importlib.util.find_spec(module) else [f"no module {module}"]
    script, args = argv[1], argv[2:]
    if not Path(script).is_file():
        return [f"missing: {script}"]
    checked.append(f"{script}'s arguments parsed")
    why, namespace = parse_only(script, args)
    if why:
        return [f"{script}: {why}"]
    if hasattr(namespace, "config") and hasattr(namespace, "overrides"):  # a tool over a config (bench_step.py)
        return config_problems(namespace.config, namespace.overrides, notes)
    return []


fields = [f.decode() for f in Path(todo).read_bytes().split(b"\0")[:-1]]
order, found = [], {}  # step -> (problems, checked, notes)
while fields:
    name, kind, count = fields[0], fields[1], int(fields[2])
    args, fields = fields[3 : 3 + count], fields[3 + count :]
    if name not in found:
        order.append(name)
        found[name] = ([], [], set())
    problems, checked, notes = found[name]
    if kind == "fail":
        problems.append(args[0])
    elif kind == "run":
        try:
            problems += command_problems(args, checked, notes)
        except Exception as e:  # e.g. this python lacks torch: said as the step's problem, the next steps checked
            problems.append(f"checking `{' '.join(args)[:200]}`: {type(e).__name__}: {e}")
failed = 0
for name in order:
    problems, checked, notes = found[name]
    if problems:
        failed += 1
        print(f"dry-run FAILED {name}: " + "; ".join(problems))
        continue
    counts = {what: checked.count(what) for what in dict.fromkeys(checked)}
    said = ", ".join(f"{n} x {what}" if n > 1 else what for what, n in counts.items())
    aside = f"; this machine has {', '.join(sorted(notes))} (not checked)" if notes else ""
    print(f"dry-run ok {name} ({said or 'nothing to run'}{aside})")
sys.exit(1 if failed else 0)
