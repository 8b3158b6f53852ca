#!/usr/bin/env bash
# Installs every system package Memory DVR needs, from Debian's archive only.
# Idempotent and quiet when everything is already present. Run as root
# (or with sudo) on Debian 12 or newer.
#
# CRIU must be 4.x (Debian 12's 3.17 fails on kernels >= 6.13), and
# scikit-build-core (the build backend of pyproject.toml) is not in Debian 12,
# so the Debian 13 (trixie) suite is added with pin priority 100: nothing moves
# to trixie unless asked for, and we ask only for criu, libcriu-dev (with their
# dependencies from trixie), python3-scikit-build-core and python3-packaging
# (these two alone: python3-pathspec and python3-pyproject-metadata come from
# the release itself; scikit-build-core 0.11 needs packaging >= 23.2, Debian 12
# has 23.0 and fails with "module 'packaging.utils' has no attribute
# 'InvalidName'"; pip keeps its own copy of packaging, unaffected).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git ninja-build
  libpmem2-dev libxxhash-dev libzstd-dev zstd
  catch2
  python3 python3-dev pybind11-dev python3-numpy python3-pytest python3-pip
  python3-nbclient python3-ipykernel python3-nbformat jupyter-client
  openmpi-bin libopenmpi-dev python3-mpi4py gfortran
  openssh-client openssh-server
  iproute2 util-linux procps
  redis-server redis-tools
)
TRIXIE_PACKAGES=(criu libcriu-dev)   # installed with -t trixie
TRIXIE_ONLY_PACKAGES=(python3-scikit-build-core python3-packaging)  # as PKG/trixie
declare -A MIN_VERSION=([python3-packaging]=23.2)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps.sh: run as root (or install sudo)" >&2; exit 1; }
  SUDO=sudo
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

criu_ok=0
if command -v criu >/dev/null 2>&1; then
  v=$(criu --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\).*/\1/p')
  [ "${v:-0}" -ge 4 ] && dpkg-query -W -f='${Status}' libcriu-dev 2>/dev/null | grep -q "install ok installed" && criu_ok=1
fi

trixie_only_missing=()
for p in "${TRIXIE_ONLY_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
     { [ -n "${MIN_VERSION[$p]:-}" ] &&
       ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' "$p")" ge "${MIN_VERSION[$p]}"; }; then
    trixie_only_missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ] && [ $criu_ok -eq 1 ] && [ ${#trixie_only_missing[@]} -eq 0 ]; then
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
APT="$SUDO apt-get -qq -o Dpkg::Use-Pty=0 -o APT::Install-Recommends=false"

. /etc/os-release
if [ $criu_ok -eq 0 ] || [ ${#trixie_only_missing[@]} -gt 0 ]; then
  if [ "${VERSION_CODENAME:-}" != "trixie" ] && [ ! -f /etc/apt/sources.list.d/dvr-trixie.sources ]; then
    $SUDO tee /etc/apt/sources.list.d/dvr-trixie.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    $SUDO tee /etc/apt/preferences.d/dvr-trixie-pin >/dev/null <<'PIN'
# Memory DVR: take nothing from trixie unless asked for (criu, libcriu-dev,
# python3-scikit-build-core, python3-packaging).
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
  fi
fi

to_install=("${missing[@]}")
if [ $criu_ok -eq 0 ]; then to_install+=("${TRIXIE_PACKAGES[@]}"); fi
to_install+=("${trixie_only_missing[@]}")
echo "install-deps.sh: installing ${to_install[*]}" >&2
$APT update >/dev/null
if [ ${#missing[@]} -gt 0 ]; then
  $APT install "${missing[@]}" >/dev/null
fi
if [ $criu_ok -eq 0 ]; then
  if [ "${VERSION_CODENAME:-}" = "trixie" ]; then
    $APT install "${TRIXIE_PACKAGES[@]}" >/dev/null
  else
    $APT install -t trixie "${TRIXIE_PACKAGES[@]}" >/dev/null
  fi
fi
if [ ${#trixie_only_missing[@]} -gt 0 ]; then
  # PKG/trixie: the package itself from trixie, its dependencies from this
  # release where it has them (-t trixie would take them from trixie too).
  # Not keyed on VERSION_CODENAME: -t trixie above may have upgraded base-files,
  # so /etc/os-release can say trixie while most packages are still bookworm's.
  $APT install "${trixie_only_missing[@]/%//trixie}" >/dev/null
fi
