#!/usr/bin/env bash
# Builds the sdists of both distributions into dist-sdist/ (prime_kernels_core-X.tar.gz from the
# repository root, prime_kernels-X.tar.gz from dropin/) and checks them with `twine check --strict`.
# Timestamps are SOURCE_DATE_EPOCH (by default the commit's time), so one commit gives the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(bash ci/check_versions.sh)
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}"
VENV="${PRIME_KERNELS_BUILD_VENV:-.venv-build}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt scikit-build-core \
  build twine
rm -rf dist-sdist
# The commit and its time, for build_info() of wheels built from the sdist (CMakeLists.txt reads them where
# there is no .git and no SOURCE_DATE_EPOCH).
git rev-parse --short=12 HEAD > .git_sha
echo "$SOURCE_DATE_EPOCH" > .source_date_epoch
trap 'rm -f .git_sha .source_date_epoch' EXIT
"$VENV/bin/python" -m build --sdist --no-isolation --outdir dist-sdist . >/dev/null
"$VENV/bin/python" -m build --sdist --no-isolation --outdir dist-sdist dropin >/dev/null
"$VENV/bin/twine" check --strict dist-sdist/prime_kernels_core-"$VERSION".tar.gz dist-sdist/prime_kernels-"$VERSION".tar.gz
ls -l dist-sdist
