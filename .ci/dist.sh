#!/usr/bin/env bash
# `make dist`: the release files of the version in modelpack/_version.py, under $DIST (dist/):
#   modelpack_oci-V-py3-none-any.whl, modelpack_oci-V.tar.gz   the wheel and the sdist
#   modelpack_oci-V.cdx.json                                   CycloneDX SBOM (.ci/sbom.py)
#   CHANGELOG-V.md                                             the CHANGELOG section of V
#   SHA256SUMS                                                 `sha256sum -c SHA256SUMS` checks all
# Reproducible: built from the files a clone has (tracked, plus new files git does not ignore; modes
# 0644/0755), with SOURCE_DATE_EPOCH from the last commit, and the sdist normalised
# (.ci/normalize-sdist.py); the same commit gives the same SHA256SUMS. No network: the build runs
# without isolation, with the setuptools and build of $VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
DIST=${DIST:-dist}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
version=$("$PY" .ci/release-notes.py --version)
if [ -n "$(git status --porcelain --untracked-files=normal)" ]; then
  echo "dist: the working tree differs from HEAD $(git rev-parse --short HEAD); a release is built from a clean checkout" >&2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue # deleted in the working tree, not yet committed
  mode=0644
  [ -x "$f" ] && mode=0755
  install -D -m "$mode" "$f" "$work/src/$f"
done
if ! "$PY" -m build --no-isolation --sdist --wheel --outdir "$work/out" "$work/src" >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  exit 1
fi
wheel=modelpack_oci-$version-py3-none-any.whl
sdist=modelpack_oci-$version.tar.gz
"$PY" .ci/normalize-sdist.py "$work/out/$sdist"
mkdir -p "$DIST"
rm -f "$DIST"/modelpack_oci-* "$DIST"/CHANGELOG-*.md "$DIST"/SHA256SUMS
cp "$work/out/$wheel" "$work/out/$sdist" "$DIST/"
"$PY" .ci/release-notes.py CHANGELOG.md "$version" >"$DIST/CHANGELOG-$version.md"
"$PY" .ci/sbom.py "$DIST/$wheel" >"$DIST/modelpack_oci-$version.cdx.json"
(cd "$DIST" && sha256sum -- "$wheel" "$sdist" "modelpack_oci-$version.cdx.json" "CHANGELOG-$version.md" >SHA256SUMS)
echo "dist: modelpack-oci $version (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH) in $DIST/"
cat "$DIST/SHA256SUMS"
