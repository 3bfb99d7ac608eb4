# Sourced by the engines' test-environment scripts (sglang_cpu/, vllm_window/): each environment lives outside the
# clone, so fresh clones reuse it, and is rebuilt only when its inputs change (a stamp in it holds their hash).
#
#   reuse_or_clear VENV HASH   while this script runs, hold VENV.lock (builds wait for each other); exit 0 now when
#                              VENV was built from inputs of HASH, else remove VENV, for the caller to build
#   stamp_env VENV HASH        after a build: mark VENV as built from inputs of HASH

reuse_or_clear() {
  mkdir -p "$(dirname "$1")"
  exec 9>"$1.lock"
  flock 9
  if [ -f "$1/.dapo-env-stamp" ] && [ "$(cat "$1/.dapo-env-stamp")" = "$2" ]; then
    exit 0
  fi
  rm -rf "$1"
}

stamp_env() {
  echo "$2" >"$1/.dapo-env-stamp"
}
