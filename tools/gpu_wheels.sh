#!/usr/bin/env bash
# Here, where pip reaches the index: the wheels a GPU machine without network lacks, laid out to be carried
# by the device tool, whose calls take at most 64 MiB each (docs/gpu.md, "A GPU machine without network").
#
#   bash tools/gpu_wheels.sh                megatron-core (cp312) into .whl/
#   bash tools/gpu_wheels.sh --te           also Transformer Engine 2.20.2 for CUDA 13: the 276 MB core wheel cut
#                                           into .te1/ .. .te5/ (56 MB each, one per call), its Python deps, the
#                                           meta wheel and the transformer_engine_torch source into .whl/
#   bash tools/gpu_wheels.sh --vllm [V]     also vLLM V (default 0.26.0, the newest that pins the machine's torch
#                                           2.11), CUDA build, cp312: the wheel less what a Hopper GPU does not
#                                           load (VLLM_TRIM below), cut into equal chunks .vllm1/ .vllm2/ ... (one
#                                           per call; .vllm1/SHA256SUMS checks the parts, the wheel and the
#                                           dependencies), and the dependencies the machine's image lacks
#                                           (tools/gpu_image_packages.txt) in .vdeps1/ ...
#   bash tools/gpu_wheels.sh --vllm-pack WHEEL DEPS
#                                           the same from a vLLM wheel and a folder of dependency wheels that
#                                           are already here: no index, no megatron-core
# --te and --vllm combine. DAPO_CHUNK_BYTES (default 60000000) caps each .vllm<N>/ and .vdeps<N>/ folder: with
# the checkout (about 5 MB, printed at the end) one folder a call stays under the 64 MiB.
#
# Every folder must be ignored by git, or it travels with each call: .whl/, .te*/, .vllm*/ and .vdeps*/ are in
# .gitignore. Name the folder a call needs in its carry.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."
TE_VERSION=2.20.2
VLLM_DEFAULT=0.26.0
CHUNK_BYTES=${DAPO_CHUNK_BYTES:-60000000}
CALL_BYTES=67108864  # 64 MiB: what one call carries, the checkout included
((CHUNK_BYTES > 131072)) || { echo "DAPO_CHUNK_BYTES=$CHUNK_BYTES: give more than 131072" >&2; exit 2; }
# What a Hopper GPU with Python 3.12 does not load: FlashAttention 2 (Hopper runs FA3), the vllm-rs binary (a
# Rust front end, not used by LLM(...)), deep_gemm's extension for other Pythons: 147 MB of 0.26.0's 304 MB.
VLLM_TRIM=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs
  'vllm/third_party/deep_gemm/_C.cpython-3'{10,11,13,14}'-*.so')
# vLLM requirements that nothing imports for a dense model (kernels for MoE/MLA/FP4, video, other loaders):
# not carried, nor what only they need
VLLM_SKIP="flashinfer* nvidia-cutlass-dsl tilelang quack-kernels tokenspeed-mla humming-kernels torchcodec \
pynvvideocodec fastsafetensors nvidia-cudnn-frontend nvtx"
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
# vLLM's dependencies include wheels for a newer glibc (cryptography: manylinux_2_34, llguidance: 2_31); the
# machine's Python takes manylinux_2_N up to N = 39 (the device tool's README)
VLLM_PLATFORMS=($(for n in $(seq 39 -1 17); do echo "manylinux_2_${n}_x86_64"; done) manylinux2014_x86_64 \
  manylinux1_x86_64)

usage() { sed -n 2,22p "$0"; exit 2; }
te=0 vllm="" pack_wheel="" pack_deps=""
while (($#)); do
  case $1 in
  --te) te=1; shift ;;
  --vllm)
    vllm=$VLLM_DEFAULT; shift
    if (($#)) && [[ $1 != -* ]]; then vllm=$1; shift; fi ;;
  --vllm-pack)
    (($# >= 3)) || usage
    pack_wheel=$(cd "$here" && realpath "$2"); pack_deps=$(cd "$here" && realpath "$3"); shift 3 ;;
  *) usage ;;
  esac
done

platform_args() { for p in "$@"; do echo "--platform $p"; done; }
download() {  # download DIR SPEC...: cp312 binary wheels, no dependencies (PLATFORMS may be replaced)
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(platform_args "${PLATFORMS[@]}") -d "$1" "${@:2}"
}
file_bytes() { stat -c %s "$@" | awk '{s += $1} END {print s + 0}'; }

if [[ -z "$pack_wheel" ]]; then
  mkdir -p .whl
  download .whl megatron-core==0.16.1
fi
if ((te)); then
  # pydantic: TE's recipes are pydantic dataclasses; nvdlfw-inspect: TE's debug features import it
  download .whl "transformer_engine==$TE_VERSION" pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 nvdlfw-inspect==0.2.2
  # transformer_engine_torch is published as source only (it must match the machine's torch): pip cannot
  # download a source package without building its metadata, which needs torch with CUDA, so take the file.
  sdist="transformer_engine_torch-$TE_VERSION.tar.gz"
  [[ -f ".whl/$sdist" ]] || python3 - "$sdist" <<'EOF'
import re, sys, urllib.request
name = sys.argv[1]
index = urllib.request.urlopen("https://pypi.org/simple/transformer-engine-torch/").read().decode()
url = next(u for u in re.findall(r'href="([^"#]+)', index) if u.endswith(name))
urllib.request.urlretrieve(url, f".whl/{name}")
EOF
  tmp=$(mktemp -d)
  download "$tmp" "transformer_engine_cu13==$TE_VERSION"
  rm -rf .te[0-9]*
  split -b 56000000 -d -a 1 "$tmp"/transformer_engine_cu13-*.whl "$tmp/part"
  for part in "$tmp"/part*; do
    n=$(( ${part##*part} + 1 ))
    mkdir -p ".te$n" && mv "$part" ".te$n/$(basename "$(ls "$tmp"/*.whl)").part$n"
  done
  sha256sum "$tmp"/transformer_engine_cu13-*.whl | sed 's|  .*/|  |' >.te1/SHA256SUMS
  rm -rf "$tmp"
fi
ls -la .whl .te[0-9]* 2>/dev/null || true
[[ -n "$vllm$pack_wheel" ]] || exit 0

vllm_deps() {  # vllm_deps VERSION DIR: download into DIR the wheels of vLLM's requirements the machine lacks
  local report=$tmp/report.json resolver=python3
  # pip evaluates requirement markers (python_version < "3.12", ...) for the Python it runs on, whatever
  # --python-version says: resolve with a 3.12 where there is one
  if python3.12 -c '' 2>/dev/null; then resolver=python3.12; else
    echo "(no python3.12 here: markers are read for $(python3 -V); a 3.12 gives the machine's exact set)"; fi
  # PIP_CONSTRAINT=: a pip configuration's constraints (a cap on torch, say) are for this machine, not that one
  PIP_CONSTRAINT='' "$resolver" -m pip install -q --dry-run --ignore-installed --report "$report" \
    --target "$tmp/none" --only-binary=:all: --python-version 3.12 --implementation cp \
    $(platform_args "${VLLM_PLATFORMS[@]}") "vllm==$1"
  python3 - "$report" tools/gpu_image_packages.txt "$VLLM_SKIP" >"$tmp/deps.txt" <<'EOF'
"""From pip's resolution of vLLM for cp312, the packages to carry: walk the requirements from vllm (markers as
Python 3.12 on x86-64 Linux reads them), stopping at what the image holds, torch / triton / nvidia-* (the image's
CUDA stack) and the skipped names; what only those need is left out with them."""
import fnmatch, json, re, sys
from collections import defaultdict
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

report, image_list, skip = sys.argv[1], sys.argv[2], sys.argv[3].split()
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(line.strip()) for line in open(image_list) if line.strip() and not line.startswith("#")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
resolved = {norm(item["metadata"]["name"]): item["metadata"] for item in json.load(open(report))["install"]}

def dropped(name):
    if name in image:
        return "in the image"
    if any(fnmatch.fnmatch(name, pattern) for pattern in skip):
        return "not imported for a dense model"
    if name in ("torch", "triton") or name.startswith("nvidia-"):
        return "the image's CUDA stack"
    return None

extras, reached, unresolved = defaultdict(set), set(), set()
todo = [("vllm", set())]
while todo:
    name, wanted = todo.pop()
    if name in reached and wanted <= extras[name]:
        continue
    reached.add(name)
    extras[name] |= wanted
    for text in resolved[name].get("requires_dist", []):
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras[name] | {""}):
            continue
        dep = norm(req.name)
        if dropped(dep):
            continue
        if dep in resolved:
            todo.append((dep, set(req.extras)))
        else:
            unresolved.add(dep)
keep = sorted(reached - {"vllm"})
left_out = defaultdict(list)
for name in sorted(set(resolved) - reached):
    left_out[dropped(name) or "needed only by what is left out"].append(name)
say = lambda text: print(text, file=sys.stderr)
say(f"vLLM {resolved['vllm']['version']} for cp312: {len(resolved) - 1} more packages resolved")
for why, names in left_out.items():
    say(f"  left out, {why}: {len(names)}" + (f" ({', '.join(names)})" if why != "in the image" else ""))
if unresolved:
    say(f"  required for 3.12 but not in pip's resolution (carry them by hand): {', '.join(sorted(unresolved))}")
say(f"  to carry: {len(keep)}")
print("\n".join(f"{name}=={resolved[name]['version']}" for name in keep))
EOF
  local saved=("${PLATFORMS[@]}")
  PLATFORMS=("${VLLM_PLATFORMS[@]}")
  download "$2" -q $(cat "$tmp/deps.txt")
  PLATFORMS=("${saved[@]}")
}

vllm_trim() {  # zip -d what VLLM_TRIM names, and their lines in the wheel's RECORD
  local wheel=$1 removed=() usize csize name pattern record
  local -A matched=()
  while read -r usize csize name; do
    for pattern in "${VLLM_TRIM[@]}"; do
      # shellcheck disable=SC2053  # a pattern on purpose
      if [[ $name == $pattern ]]; then
        removed+=("$name") matched[$pattern]=1
        printf '  trimmed %s: %d bytes (%d compressed)\n' "$name" "$usize" "$csize"
      fi
    done
  done < <(python3 -c 'import sys, zipfile
for i in zipfile.ZipFile(sys.argv[1]).infolist(): print(i.file_size, i.compress_size, i.filename)' "$wheel")
  for pattern in "${VLLM_TRIM[@]}"; do
    [[ -n "${matched[$pattern]:-}" ]] || echo "  (nothing in the wheel matches $pattern)"
  done
  ((${#removed[@]})) || return 0
  zip -q -nw -d "$wheel" "${removed[@]}"
  record=$(unzip -Z1 "$wheel" | awk '/[.]dist-info\/RECORD$/ && !found {print; found = 1}')
  unzip -q -d "$tmp/record" "$wheel" "$record"
  grep -v -F -f <(printf '%s,\n' "${removed[@]}") "$tmp/record/$record" >"$tmp/record.new"
  touch -r "$tmp/record/$record" "$tmp/record.new"  # its date as in the wheel: the same input, the same chunks
  mv "$tmp/record.new" "$tmp/record/$record"
  (cd "$tmp/record" && zip -q -X "$wheel" "$record")
}

vllm_pack() {  # vllm_pack WHEEL DEPS_DIR: .vllm<N>/ (trimmed wheel in chunks, SHA256SUMS) and .vdeps<N>/
  local src=$1 deps=$2 name size n part i used w b
  name=$(basename "$src")
  cp "$src" "$tmp/$name"
  echo "$name: $(file_bytes "$src") bytes"
  vllm_trim "$tmp/$name"
  size=$(file_bytes "$tmp/$name")
  # equal chunks, each at most the cap less 64 KiB (room for SHA256SUMS in .vllm1/)
  n=$(( (size + CHUNK_BYTES - 65536 - 1) / (CHUNK_BYTES - 65536) ))
  part=$(( (size + n - 1) / n ))
  echo "trimmed: $size bytes, $n chunks of at most $part bytes"
  rm -rf .vllm[0-9]* .vdeps[0-9]*
  split -b "$part" -d -a 3 "$tmp/$name" "$tmp/part."
  i=0
  for p in "$tmp"/part.*; do
    i=$((i + 1))
    mkdir ".vllm$i" && mv "$p" ".vllm$i/$name.part$i"
  done
  # the dependencies whole, in name order, a new folder when the next would pass the cap
  i=1 used=0
  for w in "$deps"/*.whl; do
    [[ -e "$w" ]] || break
    b=$(file_bytes "$w")
    ((b <= CHUNK_BYTES)) || { echo "$(basename "$w") is $b bytes, over DAPO_CHUNK_BYTES=$CHUNK_BYTES" >&2; exit 1; }
    if ((used + b > CHUNK_BYTES)); then i=$((i + 1)) used=0; fi
    mkdir -p ".vdeps$i" && cp "$w" ".vdeps$i/"
    used=$((used + b))
  done
  {
    (cd "$tmp" && sha256sum "$name")
    for d in .vllm[0-9]*/; do (cd "$d" && sha256sum -- *.part*); done
    for d in .vdeps[0-9]*/; do (cd "$d" && sha256sum -- *.whl) | sed 's|  |  deps/|'; done
  } >"$tmp/SHA256SUMS"
  mv "$tmp/SHA256SUMS" .vllm1/
}

summary() {  # each folder, its size and what a call carrying it holds with the checkout
  local checkout=0 d b fail=0
  if git rev-parse --show-toplevel >/dev/null 2>&1 && [[ "$(git rev-parse --show-toplevel)" == "$PWD" ]]; then
    checkout=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null |
      awk '{s += $1} END {print s + 0}') || true
    printf 'the checkout (tracked and untracked files that git does not ignore): %d bytes\n' "$checkout"
  fi
  echo "carry one folder a call:"
  for d in .vllm[0-9]* .vdeps[0-9]*; do
    b=$(find "$d" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    awk -v d="$d/" -v b="$b" -v n="$(find "$d" -type f | wc -l)" -v c="$checkout" 'BEGIN {
      printf "  %-9s %10d bytes (%5.1f MB), %3d files", d, b, b / 1e6, n
      if (c) printf "; with the checkout %4.1f MiB of 64", (b + c) / 1048576
      printf "\n" }'
    if ((b > CHUNK_BYTES || b + checkout > CALL_BYTES)); then echo "  $d/ is too large" >&2; fail=1; fi
  done
  return $fail
}

shopt -s nullglob
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [[ -n "$pack_wheel" ]]; then
  vllm_pack "$pack_wheel" "$pack_deps"
else
  mkdir "$tmp/wheel" "$tmp/deps"
  download "$tmp/wheel" -q "vllm==$vllm"
  vllm_deps "$vllm" "$tmp/deps"
  echo "dependencies: $(ls "$tmp"/deps/*.whl | wc -l) wheels, $(file_bytes "$tmp"/deps/*.whl) bytes"
  vllm_pack "$(ls "$tmp"/wheel/vllm-*.whl)" "$tmp/deps"
fi
summary
