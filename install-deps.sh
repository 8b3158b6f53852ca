#!/usr/bin/env bash
# Installs every system package Memory DVR needs, from Debian's archive only.
# Idempotent and quiet when everything is already present. Run as root
# (or with sudo) on Debian 12 or newer.
#
# CRIU must be 4.x (Debian 12's 3.17 fails on kernels >= 6.13), so the Debian 13
# (trixie) suite is added with pin priority 100: nothing moves to trixie unless
# asked for, and we ask only for criu and libcriu-dev.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git ninja-build
  libpmem2-dev libxxhash-dev libzstd-dev zstd
  catch2
  python3 python3-dev pybind11-dev python3-numpy python3-pytest
  python3-nbclient python3-ipykernel python3-nbformat jupyter-client
  openmpi-bin libopenmpi-dev python3-mpi4py gfortran
  openssh-client openssh-server
  iproute2 util-linux procps
)
TRIXIE_PACKAGES=(criu libcriu-dev)

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

if [ ${#missing[@]} -eq 0 ] && [ $criu_ok -eq 1 ]; then
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
APT="$SUDO apt-get -qq -o Dpkg::Use-Pty=0 -o APT::Install-Recommends=false"

if [ $criu_ok -eq 0 ]; then
  . /etc/os-release
  if [ "${VERSION_CODENAME:-}" != "trixie" ] && [ ! -f /etc/apt/sources.list.d/dvr-trixie.sources ]; then
    $SUDO tee /etc/apt/sources.list.d/dvr-trixie.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    $SUDO tee /etc/apt/preferences.d/dvr-trixie-pin >/dev/null <<'PIN'
# Memory DVR: take nothing from trixie unless asked for (criu, libcriu-dev).
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
  fi
fi

echo "install-deps.sh: installing ${missing[*]} ${TRIXIE_PACKAGES[*]}" >&2
$APT update >/dev/null
if [ ${#missing[@]} -gt 0 ]; then
  $APT install "${missing[@]}" >/dev/null
fi
if [ $criu_ok -eq 0 ]; then
  . /etc/os-release
  if [ "${VERSION_CODENAME:-}" = "trixie" ]; then
    $APT install "${TRIXIE_PACKAGES[@]}" >/dev/null
  else
    $APT install -t trixie "${TRIXIE_PACKAGES[@]}" >/dev/null
  fi
fi
