#!/usr/bin/env bash
# Install everything the platform and its tests need on a fresh Debian 12 host, as root.
# Idempotent: a second run installs nothing and takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  crun            # OCI runtime for the container backend
  erofs-utils     # mkfs.erofs: every image layer is an EROFS image
  debootstrap     # builds the debian-python image from Debian's archive
  busybox-static  # the tiny busybox image
  fuse3           # lazy layer loading (FUSE; dsec-lazyfs speaks /dev/fuse itself)
  git             # workspace layers built from a git checkout (dsec layer build --git)
  nftables        # per-sandbox egress rules
  iproute2        # network namespaces and veth
  util-linux      # unshare, nsenter, mount
  btrfs-progs     # mkfs.btrfs: sandboxes' writable disk, one quota group per sandbox
  procps psmisc   # ps, fuser: leak checks in tests
  gcc libc6-dev   # the static in-sandbox agent is compiled on the host
  libssl-dev      # dsec-lazyfs links OpenSSL: lazy loading from https:// layer stores
  libseccomp-dev  # the FnCall zygote compiles the platform's seccomp policy to BPF once
  postgresql      # cluster mode's control database (the tests start a real server)
  qemu-system-x86 # the microVM backend's VMM (TCG here, KVM where it boots a guest)
  qemu-utils      # qemu-img: a throwaway copy-on-write view of a microVM disk for verify steps
  ovmf            # UEFI firmware for full VMs (firmware="uefi")
  prometheus      # tests scrape /metrics with a real Prometheus server (started by the test)
  chromium chromium-driver # tests/test_ui.py drives the dashboard in headless Chromium (Selenium)
  docker-registry # the CNCF distribution registry: tests of the OCI-registry layer store
  skopeo          # fills test registries from archives (OCI pull tests)
  ca-certificates
  docker-registry skopeo # tests/test_oci_pull.py: a real OCI registry (CNCF distribution), filled by skopeo
)

if [ "$(id -u)" != 0 ]; then
  echo "install.sh: run as root (sandboxes need mounts, cgroups and namespaces)" >&2
  exit 1
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "install.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Kernel features the platform uses; built in on most kernels, so failures are fine.
modprobe -q overlay 2>/dev/null || true
modprobe -q erofs 2>/dev/null || true

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: Python >= 3.11 is required ($PY is $("$PY" --version))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    "$PY" -m venv .venv
  }
fi
stamp=.venv/.dsec-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
  echo "$want" >"$stamp"
fi
# The Harbor plug-in (dsec.integrations.harbor): Harbor needs Python >= 3.12 while the
# project's .venv stays on the host's 3.11, so it gets a venv of its own; skipped (with a
# note) where no 3.12 is found.
PY312=
for cand in ${PYTHON312:-} python3.12 /root/.pyenv/versions/3.12*/bin/python; do
  if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY312=$cand
    break
  fi
done
if [ -n "$PY312" ]; then
  [ -x .venv-harbor/bin/python ] || "$PY312" -m venv .venv-harbor
  hstamp=.venv-harbor/.dsec-installed
  if [ "$(cat "$hstamp" 2>/dev/null)" != "$want" ]; then
    .venv-harbor/bin/pip install -q --disable-pip-version-check -e '.[harbor]' mypy
    echo "$want" >"$hstamp"
  fi
else
  echo "install.sh: no Python 3.12 found; skipping .venv-harbor (the Harbor plug-in's tests skip)" >&2
fi
# Compile the in-sandbox agent now rather than on the first sandbox.
.venv/bin/python -c 'from dsec.agent.build import agent_binary, untrusted_binary; agent_binary(); untrusted_binary()'
.venv/bin/python -c 'from dsec.images.lazy.build import lazyfs_binary; lazyfs_binary()'
# The microVM guest: Debian's cloud kernel (fetched with apt-get download, unpacked into
# the cache, never installed) and the initramfs with dsec-vminit and the agent.
apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1 || apt-get update -qq
.venv/bin/python -c 'from dsec.guest.initramfs import guest_initramfs; guest_initramfs()'
# The dashboard's live view (/ui/desktop/<id>) draws a VM's screen with noVNC from the npm
# registry, pinned, vendored into the package's static dir (git-ignored) and served by the
# platform itself: no CDN at run time. Only its ES modules (core/, vendor/pako) and the
# licence are kept. npm comes from Debian's package when the host has no node.
NOVNC_VERSION=1.7.0
novnc_dir=src/dsec/apiserver/ui/novnc
if [ "$(cat "$novnc_dir/.version" 2>/dev/null)" != "$NOVNC_VERSION" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "@novnc/novnc@$NOVNC_VERSION" >/dev/null)
  tar -xzf "$tmp"/novnc-novnc-"$NOVNC_VERSION".tgz -C "$tmp" package/core package/vendor package/LICENSE.txt
  rm -rf "$novnc_dir.new"
  mkdir -p "$novnc_dir.new"
  cp -r "$tmp/package/core" "$tmp/package/vendor" "$tmp/package/LICENSE.txt" "$novnc_dir.new/"
  echo "$NOVNC_VERSION" >"$novnc_dir.new/.version"
  rm -rf "$novnc_dir"
  mv "$novnc_dir.new" "$novnc_dir"
  rm -rf "$tmp"
  trap - EXIT
fi
# Byte-compile the package. An editable install leaves src/ uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (container images often set it; our machines do) the
# interpreter never caches what it compiles: every `dsec` process, each platform start
# and CLI call, compiled ~300 modules again. Stale files are ignored by their mtime.
.venv/bin/python -m compileall -q -j 0 src/dsec >/dev/null
