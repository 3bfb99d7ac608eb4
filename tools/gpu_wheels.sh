#!/usr/bin/env bash
# Here, where pip reaches the index: the wheels a GPU machine without network lacks, laid out to be carried
# by the device tool, whose calls take at most 64 MiB each (docs/gpu.md, "A GPU machine without network").
#
#   bash tools/gpu_wheels.sh            megatron-core (cp312) into .whl/
#   bash tools/gpu_wheels.sh --te       also Transformer Engine 2.20.2 for CUDA 13: the 276 MB core wheel cut
#                                       into .te1/ .. .te5/ (56 MB each, one per call), its Python deps, the
#                                       meta wheel and the transformer_engine_torch source into .whl/
#
# Both folders must be ignored by git (.git/info/exclude: /.whl/ and /.te*/) and named in the call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
TE_VERSION=2.20.2
download() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
mkdir -p .whl
download .whl megatron-core==0.16.1
if [[ "${1:-}" == "--te" ]]; then
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
ls -la .whl .te* 2>/dev/null
