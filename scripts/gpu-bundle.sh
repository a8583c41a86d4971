#!/usr/bin/env bash
# scripts/gpu-bundle.sh: build the workspace's test binaries (and, optionally, named binaries, examples or benches)
# in release mode here, and lay them out in .gpu/ for a run on the GPU machine, which has the NVIDIA
# driver but no Rust toolchain. Both machines are x86-64; the binaries load libcuda at run time.
#
#   scripts/gpu-bundle.sh                      # all test binaries of the workspace
#   scripts/gpu-bundle.sh --bin NAME ...  # plus these binaries (--example NAME, --bench NAME too)
#   scripts/gpu-bundle.sh --features F    # build everything with these cargo features (e.g. cudarc)
#   scripts/gpu-bundle.sh --no-hooks ...  # the named programs without the model's hooks (a user's
#                                         # build: for measurements; the tests keep them)
#
# Then, on a machine with an NVIDIA GPU, from a copy of the repository that includes .gpu/:
#   bash .gpu/run-tests.sh [extra test-harness args]
# run-tests.sh runs every test binary with --include-ignored (GPU tests are #[ignore]d for CI) and
# prints a last line 'N passed, N failed'. Other bundled programs lie in .gpu/bin/.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-path info/exclude)   # also in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/tests .gpu/bin
extra=()
feats=()
no_hooks=0
while (($#)); do
  case "$1" in
    --bin|--example|--bench) extra+=("$1" "$2"); shift 2 ;;
    --features) feats=(--features "$2"); shift 2 ;;
    --no-hooks) no_hooks=1; shift ;;
    *) echo "gpu-bundle: unknown argument $1" >&2; exit 2 ;;
  esac
done
msgs=$(mktemp)
cargo test --workspace --release --no-run "${feats[@]}" --message-format=json-render-diagnostics > "$msgs"
python3 - "$msgs" .gpu/tests <<'PY'
import json, shutil, sys, os
seen = set()
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        exe = m["executable"]
        name = f'{m["target"]["kind"][0]}-{m["target"]["name"]}'
        if name in seen: name += "-" + m["package_id"].split("#")[-1].replace("@", "-")
        seen.add(name)
        shutil.copy2(exe, os.path.join(sys.argv[2], name))
PY
if ((${#extra[@]})); then
  if ((no_hooks)); then
    # The crate's dev-dependency on itself turns the hooks on for every example and bench (and,
    # by feature unification, for whatever is built with them): drop it for this build only.
    cp Cargo.toml .gpu/Cargo.toml.orig
    trap 'cp .gpu/Cargo.toml.orig Cargo.toml; rm -f .gpu/Cargo.toml.orig' EXIT
    sed -i 's/"model-hooks", //' Cargo.toml
    grep -q model-hooks <(sed -n '/^\[dev-dependencies\]/,/^\[/p' Cargo.toml) && {
      echo "gpu-bundle: could not drop model-hooks from the dev-dependencies" >&2; exit 1; }
  fi
  cargo build --release "${feats[@]}" "${extra[@]}" --message-format=json-render-diagnostics > "$msgs"
  python3 - "$msgs" .gpu/bin <<'PY'
import json, shutil, sys, os
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        shutil.copy2(m["executable"], os.path.join(sys.argv[2], os.path.basename(m["executable"])))
PY
fi
rm -f "$msgs"
strip .gpu/tests/* .gpu/bin/* 2>/dev/null || true
cat > .gpu/run-tests.sh <<'SH'
#!/usr/bin/env bash
# Runs every bundled test binary, GPU tests included; the working directory is the repository root.
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
pass=0 fail=0
# Tests that run a bundled program find it as cargo would tell them (CARGO_BIN_EXE_<name>).
envs=()
for b in .gpu/bin/*; do [ -f "$b" ] && envs+=("CARGO_BIN_EXE_${b##*/}=$PWD/$b"); done
for t in .gpu/tests/*; do
  echo "=== ${t##*/}"
  if out=$(env "${envs[@]}" "$t" --include-ignored "$@" 2>&1); then :; fi
  echo "$out" | grep -E '^(test |failures:|---- )|panicked|test result' | grep -v '\.\.\. ok$' || true
  p=$(echo "$out" | sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' | awk '{s+=$1} END {print s+0}')
  f=$(echo "$out" | sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' | awk '{s+=$1} END {print s+0}')
  if ! echo "$out" | grep -q '^test result'; then f=$((f+1)); echo "$out" | tail -20; fi
  pass=$((pass+p)); fail=$((fail+f))
done
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
SH
chmod +x .gpu/run-tests.sh
du -sh .gpu | sed 's/^/gpu-bundle: /'
echo "gpu-bundle: on the GPU machine, with .gpu/ beside the sources: bash .gpu/run-tests.sh"
