#!/usr/bin/env bash
# ABI check of wrapper.h against the official CUDA header, on a machine with the CUDA toolkit.
#
#   bash scripts/abi-check.sh            # uses /usr/local/cuda/include (or $CUDA_INCLUDE)
#
# 1. Signatures and handle types: a C file includes the official cuda.h and then wrapper.h with
#    CSP_ABI_CHECK defined (which leaves out wrapper.h's enum definitions). C11 allows a function
#    to be redeclared and a typedef to be redefined only with the same type, so any difference is
#    a compile error.
# 2. Enum values: every `NAME = VALUE` of wrapper.h's enum section becomes a static assertion
#    against the official constant.
# 3. Names: every entry point of wrapper.h must be declared by cuda.h itself under that exact
#    (versioned) name, so a function the header no longer declares cannot slip through check 1.
# Prints "abi-check: OK (...)" and exits 0 when all three compile.
set -euo pipefail
inc=${CUDA_INCLUDE:-/usr/local/cuda/include}
root=$(cd "$(dirname "$0")/.." && pwd)
cc=${CC:-cc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -f "$inc/cuda.h" ] || { echo "abi-check: no cuda.h under $inc" >&2; exit 2; }

printf '#include <cuda.h>\n#define CSP_ABI_CHECK\n#include "wrapper.h"\n' > "$tmp/sig.c"

sed -n '/^#ifndef CSP_ABI_CHECK/,/^#endif \/\* CSP_ABI_CHECK/p' "$root/wrapper.h" |
  sed -nE 's/^[[:space:]]+(CU[A-Z0-9_]+)[[:space:]]*=[[:space:]]*((0x)?[0-9a-fA-F]+).*/\1 \2/p' > "$tmp/enums"
{
  echo '#include <cuda.h>'
  while read -r name value; do
    echo "_Static_assert($name == $value, \"$name differs from cuda.h\");"
  done < "$tmp/enums"
  # wrapper.h's CUmemPoolProps is the CUDA 11.2 layout: same size and offsets of what it sets.
  echo '#include <stddef.h>'
  echo '_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps size differs");'
  echo '_Static_assert(offsetof(CUmemPoolProps, location) == 8, "CUmemPoolProps.location moved");'
  echo '_Static_assert(offsetof(CUmemPoolProps, win32SecurityAttributes) == 16, "moved");'
  echo '_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation size differs");' 
} > "$tmp/enums.c"

grep -oE '^CUresult (cu[A-Za-z0-9_]+)\(' "$root/wrapper.h" | sed -E 's/^CUresult (cu[A-Za-z0-9_]+)\(/\1/' > "$tmp/all_fns"
# Older entry points that newer headers no longer declare (drivers keep exporting them for old
# binaries; the crate uses them only when the newer one is missing). When this cuda.h does not
# declare one, its name check is skipped (check 1 still compiles wrapper.h's declaration).
legacy="cuStreamGetCaptureInfo_v2"
: > "$tmp/fns"
skipped=""
while read -r f; do
  if [[ " $legacy " == *" $f "* ]] &&
     ! printf '#include <cuda.h>\nvoid *p = (void *)&%s;\n' "$f" |
       $cc -std=c11 -I "$inc" -x c -c - -o /dev/null 2>/dev/null; then
    skipped="$skipped $f"
  else
    echo "$f" >> "$tmp/fns"
  fi
done < "$tmp/all_fns"
{
  echo '#include <cuda.h>'
  echo 'void *csp_entry_points[] = {'
  while read -r f; do echo "  (void *)&$f,"; done < "$tmp/fns"
  echo '};'
} > "$tmp/names.c"
# A macro in cuda.h (cuStreamDestroy -> cuStreamDestroy_v2) must not rename the versioned names
# wrapper.h uses: check that each name survives preprocessing unchanged.
for f in $(cat "$tmp/fns"); do
  out=$(printf '#include <cuda.h>\n%s\n' "$f" | $cc -E -P -I "$inc" - | tail -n 1)
  [ "$out" = "$f" ] || { echo "abi-check: cuda.h renames $f to $out" >&2; exit 1; }
done

fail=0
for t in sig enums names; do
  if ! $cc -std=c11 -Wall -Werror -I "$inc" -I "$root" -c "$tmp/$t.c" -o "$tmp/$t.o" 2> "$tmp/$t.err"; then
    echo "abi-check: $t check failed:" >&2
    cat "$tmp/$t.err" >&2
    fail=1
  fi
done
[ "$fail" = 0 ] || exit 1
ver=$(sed -nE 's/^#define CUDA_VERSION ([0-9]+).*/\1/p' "$inc/cuda.h")
echo "abi-check: OK ($(wc -l < "$tmp/fns") functions, $(wc -l < "$tmp/enums") enum values, against $inc/cuda.h, CUDA_VERSION $ver)${skipped:+; not declared by this header (legacy):$skipped}"
