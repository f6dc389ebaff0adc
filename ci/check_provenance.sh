#!/usr/bin/env bash
# The sha256 values of third_party/PROVENANCE.md (or $PRIME_KERNELS_PROVENANCE), as the build uses them.
# usage: ci/check_provenance.sh FILE...      each FILE must be listed (by file name) with its sha256
#        ci/check_provenance.sh --hashes NAME  print "--hash=sha256:..." for every wheel of NAME listed
set -euo pipefail
TABLE="${PRIME_KERNELS_PROVENANCE:-$(cd "$(dirname "$0")/.." && pwd)/third_party/PROVENANCE.md}"
# Rows: | name | version | file | sha256 | licence | how |. Prints "file sha256" for rows with a real hash.
rows() { awk -F'|' 'NF >= 6 { f=$4; h=$5; gsub(/[ \t`]/, "", f); gsub(/[ \t`]/, "", h);
                               if (length(h) == 64 && h ~ /^[0-9a-f]+$/) print f, h }' "$TABLE"; }
if [ "${1:-}" = --hashes ]; then
  name="${2:?usage: ci/check_provenance.sh --hashes NAME}"
  out=$(rows | awk -v n="$name" 'index($1, n "-") == 1 { printf "--hash=sha256:%s ", $2 }')
  [ -n "$out" ] || { echo "error: $TABLE lists no sha256 for $name" >&2; exit 1; }
  echo "$out"
  exit 0
fi
[ $# -gt 0 ] || { echo "usage: ci/check_provenance.sh FILE... | --hashes NAME" >&2; exit 2; }
status=0
for f in "$@"; do
  want=$(rows | awk -v b="$(basename "$f")" '$1 == b { print $2; exit }')
  got=$(sha256sum "$f" | cut -d' ' -f1)
  if [ -z "$want" ]; then echo "error: $(basename "$f") is not listed in $TABLE" >&2; status=1
  elif [ "$want" != "$got" ]; then echo "error: $(basename "$f"): sha256 $got, $TABLE says $want" >&2; status=1
  else echo "ok: $(basename "$f") $got"; fi
done
exit "$status"
