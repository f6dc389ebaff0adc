#!/usr/bin/env bash
# The two distributions of one build carry one version: prime-kernels (dropin/pyproject.toml) must have
# the version of prime-kernels-core (pyproject.toml) and depend on exactly that version of it.
# Prints the version; exits 1 with what differs otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
field() { sed -nE "s/^$1 = \"([^\"]*)\"\$/\1/p" "$2" | head -n 1; }
core=$(field version pyproject.toml)
dropin=$(field version dropin/pyproject.toml)
pin=$(sed -nE 's/^dependencies = \["prime-kernels-core==([^"]*)"\]$/\1/p' dropin/pyproject.toml)
status=0
[ -n "$core" ] || { echo "error: no version in pyproject.toml" >&2; status=1; }
[ "$dropin" = "$core" ] || { echo "error: dropin/pyproject.toml has version '$dropin', pyproject.toml '$core'" >&2; status=1; }
[ "$pin" = "$core" ] || { echo "error: dropin/pyproject.toml must depend on exactly prime-kernels-core==$core (it pins '$pin')" >&2; status=1; }
[ "$status" -eq 0 ] && echo "$core"
exit "$status"
