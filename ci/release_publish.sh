#!/usr/bin/env bash
# Checks that the tag matches the version of both distributions, then opens a draft GitHub release with the wheels and sdists.
# The PyPI upload itself is the workflow's trusted-publishing step; the draft is published after it.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:?usage: release_publish.sh vX.Y.Z}"
version=$(bash ci/check_versions.sh)  # the one version of prime-kernels-core and the prime-kernels drop-in
[ "$tag" = "v$version" ] || { echo "tag $tag does not match pyproject version $version"; exit 1; }
python -m pip install --quiet -c ci/constraints.txt twine
python -m twine check --strict wheelhouse/*.whl wheelhouse/*.tar.gz
gh release create "$tag" --draft --title "prime-kernels $version" --notes "prime-kernels $version" \
  wheelhouse/*.whl wheelhouse/*.tar.gz
