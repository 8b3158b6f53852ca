#!/usr/bin/env bash
# Installs every system package Memory DVR needs, from Debian's archive only.
# Idempotent, and quiet and fast when everything is already present. Run as
# root (or it re-runs itself with sudo) on Debian 12 or newer.
#   install-deps.sh [--dry-run] [--rebuild-criu]
#     --dry-run       print what it would install, from where, and whether it would
#                     build CRIU; change nothing
#     --rebuild-criu  build CRIU from source again (ignores the cache and any CRIU
#                     already installed), then install it
#
# Policy: a compiled package (any Architecture but "all") comes only from this
# system's own release. Taking one from another release (apt-get -t trixie) is
# how an earlier version of this script moved a Debian 12 root to trixie's libc6
# 2.41 and base-files 13. Every install is simulated first and refused if apt
# would take a compiled package from another release, or remove anything.
#
# CRIU must be >= 4.2 (Debian 12's 3.17 cannot run on kernels >= 6.13; 4.1 cannot
# dump TCP/UDP sockets on Linux >= 6.16). Where this release's own criu is
# older, the script builds it from Debian's source package in forky (a deb-src
# source, in a private apt configuration under /var/cache/memory-dvr/apt-src:
# the system's apt sources never see it) with build dependencies from this
# release, as local packages criu, libcompel1, libcriu2 and libcriu-dev version
# <upstream>-1~dvr1 (an official package of the same upstream version replaces
# them), caches the .debs in /var/cache/memory-dvr/criu-<version>/ and installs
# them. The archive reachable here lacks forky's packaging tarball (the
# .debian.tar.xz answers 404), so the debian/ directory is written below: the
# same binary packages, file layout and relationships as Debian's criu 4.x.
#
# Pure-Python packages (Architecture: all) that Debian 12 lacks may come from the
# next release, trixie, as PKG/trixie: the package itself from trixie, its
# dependencies from this release. scikit-build-core (the build backend of
# pyproject.toml) is not in Debian 12, and 0.11 needs packaging >= 23.2 (Debian
# 12 has 23.0 and fails with "module 'packaging.utils' has no attribute
# 'InvalidName'"; pip keeps its own copy of packaging, unaffected). trixie is
# added as a binary source with pin priority 100, so that nothing else comes
# from it unless asked for, and only these two are asked for.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git ninja-build
  libpmem2-dev libxxhash-dev libzstd-dev zstd xxhash
  libjemalloc-dev libsodium-dev
  catch2
  python3 python3-dev pybind11-dev python3-numpy python3-pytest python3-pip
  python3-nbclient python3-ipykernel python3-nbformat jupyter-client
  openmpi-bin libopenmpi-dev python3-mpi4py gfortran
  openssh-client openssh-server
  iproute2 util-linux procps
  redis-server redis-tools
  memcached python3-pymemcache
  libcli11-dev nlohmann-json3-dev python3-tqdm mypy
  libcpp-httplib-dev libssl-dev openssl
  chromium
)
# The dashboard (web/) is built with node >= 18 and npm: Debian's nodejs and npm,
# unless an npm is on PATH already (say from NodeSource, whose nodejs package
# conflicts with Debian's npm). chromium runs its end-to-end tests (tests/web).
command -v npm >/dev/null 2>&1 || PACKAGES+=(nodejs npm)
NEXT_RELEASE_PACKAGES=(python3-scikit-build-core python3-packaging)  # Architecture: all, as PKG/trixie
declare -A MIN_VERSION=([python3-packaging]=23.2)
CRIU_MIN=4.2
CRIU_PACKAGES=(criu libcompel1 libcriu2 libcriu-dev)  # what a CRIU build makes and installs
CRIU_SOURCE_SUITE=forky   # the Debian suite whose source package criu is built (>= CRIU_MIN)
CRIU_LOCAL_REVISION=1~dvr1
CRIU_SRC_VERSION=""        # the version of the source package, once known
CACHE=/var/cache/memory-dvr
LOG=$CACHE/install-deps.log
# Debian suite names: a compiled package from one of these other than this
# release (and its -updates, -security, -backports) is refused.
DEBIAN_SUITES=" buster bullseye bookworm trixie forky duke sid unstable testing stable oldstable oldoldstable experimental "

dry_run=0 rebuild_criu=0
for a in "$@"; do
  case $a in
    -n|--dry-run) dry_run=1 ;;
    --rebuild-criu) rebuild_criu=1 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done

# ---- the fast path: one dpkg-query, nothing else -------------------------------
declare -A have=()
while read -r p s v; do
  [ "$s" = ii ] && have[${p%%:*}]=$v
done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev} ${Version}\n' \
           "${PACKAGES[@]}" "${NEXT_RELEASE_PACKAGES[@]}" "${CRIU_PACKAGES[@]}" 2>/dev/null || true)
missing=()
for p in "${PACKAGES[@]}"; do [ -n "${have[$p]:-}" ] || missing+=("$p"); done
next_missing=()
for p in "${NEXT_RELEASE_PACKAGES[@]}"; do
  if [ -z "${have[$p]:-}" ] ||
     { [ -n "${MIN_VERSION[$p]:-}" ] && ! dpkg --compare-versions "${have[$p]}" ge "${MIN_VERSION[$p]}"; }; then
    next_missing+=("$p")
  fi
done
criu_ok=1
for p in criu libcriu-dev; do
  [ -n "${have[$p]:-}" ] && dpkg --compare-versions "${have[$p]}" ge "$CRIU_MIN~" || criu_ok=0
done
[ $rebuild_criu -eq 1 ] && criu_ok=0
if [ ${#missing[@]} -eq 0 ] && [ ${#next_missing[@]} -eq 0 ] && [ $criu_ok -eq 1 ]; then
  [ $dry_run -eq 1 ] && echo "install-deps.sh --dry-run: nothing to do (all packages present; criu ${have[criu]})"
  exit 0
fi

# ---- there is work: root, a lock, a log -----------------------------------------
if [ $dry_run -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps.sh: run as root (or install sudo)" >&2; exit 1; }
  exec sudo -- bash "$0" "$@"
fi
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
say() { echo "install-deps.sh: $*" >&2; }
die() { say "$*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ $dry_run -eq 0 ]; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9
  : >"$LOG"
fi
# run STEP CMD...: runs CMD with its output in the log; on failure prints the end of it
run() {
  local step=$1; shift
  echo "== $(date +%T) $step: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 && return 0
  say "$step failed; the last lines of $LOG:"
  tail -n 30 "$LOG" | cut -c1-200 | sed 's/^/  | /' >&2
  exit 1
}

# ---- this system's release and archive -------------------------------------------
# The system's own binary sources, "URI SUITE" per line (ours, dvr-*, left out).
# /etc/os-release is not asked: an earlier install may have moved base-files.
system_sources() {
  [ -f /etc/apt/sources.list ] &&
    sed -e 's/\[[^]]*\]//' /etc/apt/sources.list | awk '$1 == "deb" { print $2, $3 }'
  local f
  for f in /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && [[ $(basename "$f") != dvr-* ]] &&
      sed -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" { print $2, $3 }'
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && [[ $(basename "$f") != dvr-* ]] && awk '
      function flush() { if (bin && on) for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print u[i], s[j]
                         bin = 0; on = 1; nu = 0; ns = 0 }
      BEGIN { on = 1 }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      tolower($1) == "types:"   { for (i = 2; i <= NF; i++) if ($i == "deb") bin = 1 }
      tolower($1) == "uris:"    { for (i = 2; i <= NF; i++) u[++nu] = $i }
      tolower($1) == "suites:"  { for (i = 2; i <= NF; i++) s[++ns] = $i }
      tolower($1) == "enabled:" { if (tolower($2) == "no") on = 0 }
      END { flush() }' "$f"
  done
}
srcs=$(system_sources || true)
REL=$(awk '$2 !~ /[-\/]/ { print $2; exit }' <<<"$srcs")
if [ -z "$REL" ]; then REL=$(. /etc/os-release; echo "${VERSION_CODENAME:-}"); fi
[ -n "$REL" ] || die "cannot tell this system's release from its apt sources"
case $REL in  # an alias (stable, oldstable...): its codename, from the Release file
  stable|oldstable|oldoldstable|testing|unstable)
    c=$(sed -n 's/^Codename: *//p' /var/lib/apt/lists/*_dists_"${REL}"_*Release 2>/dev/null | head -n1)
    [ -n "$c" ] && REL=$c ;;
esac
MIRROR=$(awk -v r="$REL" '$2 == r && $1 ~ /\/debian\/?$/ { print $1; exit }' <<<"$srcs")
MIRROR=${MIRROR:-http://deb.debian.org/debian}
MIRROR=${MIRROR%/}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
case $REL in bookworm) NEXT=trixie ;; *) NEXT="" ;; esac

# apt restricted to the system's own sources (ours, dvr-*, left out): whatever it
# installs comes from this release by construction. $tmp/prefs.d may get a pin.
mkdir -p "$tmp/sources.d" "$tmp/prefs.d"
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && [[ $(basename "$f") != dvr-* ]] && cp "$f" "$tmp/sources.d/"
done
for f in /etc/apt/preferences.d/*; do
  [ -f "$f" ] && [[ $(basename "$f") != dvr-* ]] && cp "$f" "$tmp/prefs.d/"
done
APT_OPTS=(-o Dpkg::Use-Pty=0 -o APT::Install-Recommends=false -o Dpkg::Options::=--force-confold)
SYS_APT=(apt-get "${APT_OPTS[@]}" -o Dir::Etc::SourceParts="$tmp/sources.d"
         -o Dir::Etc::PreferencesParts="$tmp/prefs.d" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)
SYS_APT_CACHE=(apt-cache -o Dir::Etc::SourceParts="$tmp/sources.d" -o Dir::Etc::PreferencesParts="$tmp/prefs.d"
               -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)
FULL_APT=(apt-get "${APT_OPTS[@]}")
# forky's sources, deb-src only, in an apt configuration of their own
SRC_DIR=$CACHE/apt-src
SRC_APT_OPTS=(-o Dir::Etc::SourceList="$SRC_DIR/empty.list" -o Dir::Etc::SourceParts="$SRC_DIR/sources.list.d"
              -o Dir::Etc::PreferencesParts="$SRC_DIR/empty.d" -o Dir::State::Lists="$SRC_DIR/lists"
              -o Dir::State::status="$SRC_DIR/empty.status" -o Dir::Cache="$SRC_DIR/cache"
              -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)

# check_plan WHAT SIMULATION [next] [downgrades]: refuses a plan (apt-get -s output)
# that removes anything, or takes a compiled package from another release; with
# "next", Architecture: all packages may come from $NEXT; with "downgrades", a
# package may go back to this release's version (not an essential or required
# one). Sets PLAN ("pkg=version(suite) ...") and NEW_PKGS (those not installed yet).
check_plan() {
  local what=$1 sim=$2 next=${3:-} downgrades=${4:-} bad=() line p old ver arch
  local -a inst=()
  if grep -q '^Remv ' <<<"$sim"; then
    bad+=("it would remove $(awk '/^Remv /{printf "%s ", $2}' <<<"$sim")")
  fi
  local re='^Inst ([^ ]+) (\[([^]]*)\] )?\(([^ ]+) .*\[([^]]*)\]\)'
  while read -r line; do
    [[ $line =~ $re ]] || continue
    inst+=("${BASH_REMATCH[1]%%:*}|${BASH_REMATCH[3]:-}|${BASH_REMATCH[4]}|${BASH_REMATCH[5]}")
  done < <(grep '^Inst ' <<<"$sim")
  PLAN="" NEW_PKGS=()
  [ ${#inst[@]} -gt 0 ] || return 0
  local madison
  madison=$("${SYS_APT_CACHE[@]}" madison $(printf '%s\n' "${inst[@]}" | cut -d'|' -f1 | sort -u) 2>/dev/null || true)
  [ "$next" = next ] && madison+=$'\n'$(apt-cache madison $(printf '%s\n' "${inst[@]}" | cut -d'|' -f1 | sort -u) 2>/dev/null || true)
  for line in "${inst[@]}"; do
    IFS='|' read -r p old ver arch <<<"$line"
    [ "$old" = "$ver" ] && old=""
    local suites s ok=0 where=""
    suites=$(awk -F' [|] ' -v p="$p" -v v="$ver" '{gsub(/^ +| +$/, "", $1); gsub(/^ +| +$/, "", $2)}
                                               $1 == p && $2 == v && $3 ~ / Packages *$/ { split($3, w, " "); sub(/\/.*/, "", w[2]); print w[2] }' <<<"$madison" | sort -u)
    for s in $suites; do
      if [ "${s%%-*}" = "$REL" ]; then ok=1; where=$s; break; fi
      if [ "$arch" = all ] && [ "$next" = next ] && [ "$s" = "$NEXT" ]; then ok=1; where=$s; fi
      if [[ $DEBIAN_SUITES != *" ${s%%-*} "* ]] && [ -z "$where" ]; then ok=1; where=$s; fi
    done
    if [ $ok -eq 0 ] && [ -z "$suites" ]; then
      # a local .deb of ours
      if [[ " ${CRIU_PACKAGES[*]} " == *" $p "* && $ver == *"~dvr"* ]]; then ok=1; where=local; fi
    fi
    [ $ok -eq 1 ] || bad+=("$p $ver ($arch) would come from ${suites:-nowhere known} (not $REL)")
    if [ -n "$old" ] && dpkg --compare-versions "$ver" lt "$old"; then
      if [ "$downgrades" != downgrades ]; then
        bad+=("it would downgrade $p $old to $ver")
      elif [ -n "$(dpkg-query -W -f='${Essential}${Priority}' "$p" 2>/dev/null | grep -E 'yes|required|important')" ]; then
        bad+=("it would downgrade $p $old to $ver ($p is essential or required)")
      else
        where="$where, down from $old"
      fi
    elif [ -n "$old" ]; then
      where="$where, up from $old"
    fi
    PLAN+="$p=$ver($where) "
    [ -n "$old" ] || NEW_PKGS+=("$p")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    say "refusing to install $what:"
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
}

# simulate WHAT [next] [downgrades] -- APT-COMMAND...: simulates, checks, sets PLAN
simulate() {
  local what=$1; shift
  local flags=()
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  local sim
  sim=$("$@" -s 2>&1) || { say "apt cannot install $what:"; sed 's/^/  | /' <<<"$sim" >&2; exit 1; }
  check_plan "$what" "$sim" "${flags[@]}"
}

# summary: PLAN in short: how many packages from which suite, and every up- or
# downgrade of an installed one by name
summary() {
  local e n=0 where=() moved=()
  declare -A per=()
  for e in $(sed 's/, \(up\|down\) from /,\1-from-/g' <<<"$PLAN"); do
    n=$((n + 1))
    local s=${e#*(}; s=${s%)}
    per[${s%%,*}]=$(( ${per[${s%%,*}]:-0} + 1 ))
    if [[ $s == *,* ]]; then s=${s#*,}; moved+=("${e%%(*} (${s/-from-/ from })"); fi
  done
  [ $n -gt 0 ] || { echo "nothing to install"; return; }
  for e in "${!per[@]}"; do where+=("${per[$e]} from $e"); done
  echo "$n packages ($(IFS=,; echo "${where[*]}" | sed 's/,/, /g'))${moved:+; $(printf '%s; ' "${moved[@]}" | sed 's/; $//')}"
}

# ---- the packaging of CRIU (Debian's binary packages criu, libcompel1, libcriu2,
# libcriu-dev; no python3-pycriu, libcompel-dev, criu-ns or crit) -----------------
write_debian_dir() {  # DIR UPSTREAM_VERSION
  local d=$1/debian v=$2
  mkdir -p "$d/source"
  echo "3.0 (quilt)" >"$d/source/format"
  cat >"$d/changelog" <<EOF
criu ($v-$CRIU_LOCAL_REVISION) $REL; urgency=medium

  * Local build by Memory DVR's install-deps.sh of Debian's source package
    criu $CRIU_SRC_VERSION ($CRIU_SOURCE_SUITE), for $REL, with build dependencies
    from $REL. An official package of the same upstream version replaces it.

 -- Memory DVR install-deps.sh <root@localhost>  $(date -R)
EOF
  cat >"$d/control" <<'EOF'
Source: criu
Section: admin
Priority: optional
Maintainer: Memory DVR install-deps.sh <root@localhost>
Build-Depends:
 debhelper-compat (= 13),
 libbsd-dev,
 libcap-dev,
 libgnutls28-dev,
 libnet1-dev,
 libnftables-dev,
 libnl-3-dev,
 libprotobuf-c-dev,
 libprotobuf-dev,
 pkgconf | pkg-config,
 protobuf-c-compiler,
 protobuf-compiler,
 python3:any,
 uuid-dev,
 asciidoc <!nodoc>,
 xmlto <!nodoc>
Standards-Version: 4.6.2
Homepage: https://www.criu.org/
Rules-Requires-Root: no

Package: criu
Architecture: amd64 arm64 ppc64el riscv64 s390x
Depends: libcompel1 (= ${binary:Version}), ${misc:Depends}, ${shlibs:Depends}
Recommends: iproute2
Suggests: iptables
Description: checkpoint and restore in userspace
 criu contains the utilities to checkpoint and restore processes in
 userspace.

Package: libcriu2
Section: libs
Architecture: amd64 arm64 ppc64el riscv64 s390x
Multi-Arch: same
Depends: criu, ${misc:Depends}, ${shlibs:Depends}
Breaks: criu (<< 3.19-3~)
Replaces: criu (<< 3.19-3~)
Description: checkpoint and restore in userspace (library)
 The C library of CRIU's RPC interface.

Package: libcriu-dev
Section: libdevel
Architecture: amd64 arm64 ppc64el riscv64 s390x
Depends: libcriu2 (= ${binary:Version}), libprotobuf-c-dev, ${misc:Depends}
Breaks: criu (<< 3.19-3~)
Replaces: criu (<< 3.19-3~)
Description: checkpoint and restore in userspace (development headers)
 Headers of libcriu and of CRIU's plugin interface (criu-plugin.h).

Package: libcompel1
Section: libs
Architecture: amd64 arm64 ppc64el riscv64 s390x
Multi-Arch: same
Depends: ${misc:Depends}, ${shlibs:Depends}
Breaks: criu (<< 3.19-3~)
Replaces: criu (<< 3.19-3~)
Description: checkpoint and restore in userspace (compel library)
 compel, the parasite code injection library of CRIU.
EOF
  cat >"$d/rules" <<'EOF'
#!/usr/bin/make -f
# Profiles: nodoc (no man pages; no asciidoc, xmlto), nocheck (no effect: upstream's
# tests need root and a kernel of their own, they never run at build time).
.RECIPEPREFIX = >
export DEB_BUILD_MAINT_OPTIONS = hardening=+all
include /usr/share/dpkg/architecture.mk
LIBDIR = /usr/lib/$(DEB_HOST_MULTIARCH)
VARS = PREFIX=/usr LIBDIR=$(LIBDIR) LIBEXECDIR=$(LIBDIR) PLUGINDIR=/usr/lib/criu \
       PYTHON=python3 SKIP_PIP_INSTALL=1 WERROR=0 V=1

%:
> dh $@

override_dh_auto_build:
> dh_auto_build -- criu lib $(VARS)
ifeq (,$(filter nodoc,$(DEB_BUILD_PROFILES) $(DEB_BUILD_OPTIONS)))
> $(MAKE) docs $(VARS)
endif

override_dh_auto_install:
> $(MAKE) install-lib install-compel $(VARS) DESTDIR=$(CURDIR)/debian/tmp
> $(MAKE) install-criu $(VARS) LIBEXECDIR=/usr/libexec DESTDIR=$(CURDIR)/debian/tmp

override_dh_auto_test:

override_dh_auto_clean:
> $(MAKE) mrproper || true
EOF
  chmod 755 "$d/rules"
  cat >"$d/criu.install" <<'EOF'
usr/sbin/criu
usr/bin/compel
usr/libexec/criu/scripts
EOF
  cat >"$d/libcriu2.install" <<'EOF'
usr/lib/*/libcriu.so.*
EOF
  cat >"$d/libcriu-dev.install" <<'EOF'
usr/include/criu
usr/lib/*/libcriu.a
usr/lib/*/libcriu.so
usr/lib/*/pkgconfig/criu.pc
EOF
  cat >"$d/libcompel1.install" <<'EOF'
usr/lib/*/libcompel.so.*
usr/lib/*/compel
EOF
  cat >"$d/criu.manpages" <<'EOF'
Documentation/criu.8
Documentation/compel.1
EOF
  cat >"$d/not-installed" <<'EOF'
usr/sbin/criu-ns
usr/include/compel
usr/lib/*/libcompel.a
usr/lib/*/libcompel.so
EOF
  cat >"$d/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: criu
Source: https://github.com/checkpoint-restore/criu

Files: *
Copyright: CRIU developers (see CREDITS)
License: GPL-2
 On Debian systems, see /usr/share/common-licenses/GPL-2.

Files: lib/* compel/*
Copyright: CRIU developers (see CREDITS)
License: LGPL-2.1
 On Debian systems, see /usr/share/common-licenses/LGPL-2.1.
EOF
}

# build_dep_plan SRCDIR: simulates installing CRIU's build dependencies from this
# release and sets PLAN. A library that an earlier install took from another
# release (here libnet1 1.3 and libnftables1 1.1 from trixie) goes back to this
# release's version where this release's -dev package needs exactly that version:
# each such "Depends: LIB (= V) but W is to be installed" becomes a pin of LIB to V
# (in $tmp/prefs.d, for this step only); check_plan allows those downgrades of
# non-essential packages and refuses any removal.
build_dep_plan() {
  local src=$1 sim i pins=$tmp/prefs.d/zz-dvr-build-deps lib v
  : >"$pins"
  for i in 1 2 3 4 5 6; do
    sim=$("${SYS_APT[@]}" -s build-dep -P nocheck,nodoc "$src" 2>&1) && break
    local locked
    locked=$(sed -nE 's/.* Depends: ([^ ]+) \(= ([^)]+)\) but [^ ]+ is to be installed.*/\1 \2/p' <<<"$sim" | sort -u)
    if [ -z "$locked" ] || [ $i -eq 6 ]; then
      say "apt cannot install CRIU's build dependencies from $REL:"; sed 's/^/  | /' <<<"$sim" >&2; exit 1
    fi
    while read -r lib v; do
      printf 'Package: %s\nPin: version %s\nPin-Priority: 1001\n\n' "${lib%%:*}" "$v" >>"$pins"
    done <<<"$locked"
  done
  check_plan "CRIU's build dependencies" "$sim" "" downgrades
}

newest() {  # the newest of the Debian versions on stdin
  local v best=""
  while read -r v; do
    [ -n "$v" ] || continue
    if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v; fi
  done
  echo "$best"
}

# rel_version PKG: the newest version of PKG that this release's own suites carry
rel_version() {
  "${SYS_APT_CACHE[@]}" madison "$1" 2>/dev/null |
    awk -F' [|] ' -v r="$REL" '{gsub(/^ +| +$/, "", $2); split($3, w, " "); sub(/\/.*/, "", w[2]); sub(/-.*/, "", w[2])}
                               w[2] == r && $3 ~ / Packages *$/ { print $2 }' |
    newest
}

# ---- what to do about CRIU ------------------------------------------------------
criu_plan="" criu_cache=""
newest_cache() {  # the newest complete cache of a CRIU build >= CRIU_MIN
  local d v best="" bestv=""
  for d in "$CACHE"/criu-*/; do
    [ -f "$d/SHA256SUMS" ] || continue
    v=$(basename "$d"); v=${v#criu-}
    dpkg --compare-versions "$v" ge "$CRIU_MIN~" || continue
    if [ -z "$bestv" ] || dpkg --compare-versions "$v" gt "$bestv"; then best=${d%/}; bestv=$v; fi
  done
  echo "$best"
}
if [ $criu_ok -eq 0 ]; then
  cand_criu=$(rel_version criu) cand_dev=$(rel_version libcriu-dev)
  if [ $rebuild_criu -eq 0 ] && [ -n "$cand_criu" ] && [ -n "$cand_dev" ] &&
     dpkg --compare-versions "$cand_criu" ge "$CRIU_MIN~" && dpkg --compare-versions "$cand_dev" ge "$CRIU_MIN~"; then
    criu_plan=release
  else
    criu_cache=$(newest_cache)
    if [ $rebuild_criu -eq 0 ] && [ -n "$criu_cache" ]; then criu_plan=cache; else criu_plan=build; fi
  fi
fi

# ---- --dry-run ------------------------------------------------------------------
if [ $dry_run -eq 1 ]; then
  echo "install-deps.sh --dry-run: this system's release is $REL (archive $MIRROR); nothing is changed"
  [ -n "$(ls /var/lib/apt/lists/ 2>/dev/null | grep -v -e '^lock$' -e '^partial$' -e '^auxfiles$')" ] ||
    echo "  (no apt lists yet: a real run starts with apt-get update; what follows may be incomplete)"
  # plan ARGS-of-simulate: the checked plan, or why apt or the check refuses it
  plan() { simulate "$@" 2>&1 && summary; }
  if [ ${#missing[@]} -gt 0 ]; then
    echo "  would install from $REL: ${missing[*]}"
    if p=$(plan "${missing[*]}" -- "${SYS_APT[@]}" install "${missing[@]}"); then
      echo "    all of it: $p"
    else
      echo "    (not resolvable from the current lists; a real run updates them first):"; sed 's/^/    /' <<<"$p"
    fi
  fi
  if [ ${#next_missing[@]} -gt 0 ]; then
    if [ -n "$NEXT" ]; then
      echo "  would install from $NEXT, Architecture: all only, as PKG/$NEXT: ${next_missing[*]}"
      [ -f /etc/apt/sources.list.d/dvr-$NEXT.sources ] ||
        echo "    (adding /etc/apt/sources.list.d/dvr-$NEXT.sources, pin priority 100, first)"
      p=$(plan "${next_missing[*]}" next -- "${FULL_APT[@]}" install "${next_missing[@]/%//$NEXT}") &&
        echo "    all of it: $p"
    else
      echo "  would install from $REL: ${next_missing[*]}"
    fi
  fi
  case $criu_plan in
    release) echo "  would install criu $cand_criu and libcriu-dev $cand_dev from $REL" ;;
    cache)   echo "  would install ${CRIU_PACKAGES[*]} $(basename "$criu_cache" | sed 's/^criu-//') from the cache $criu_cache" ;;
    build)
      CRIU_SRC_VERSION=$(apt-cache "${SRC_APT_OPTS[@]}" showsrc --only-source criu 2>/dev/null | sed -n 's/^Version: *//p' | newest || true)
      v=${CRIU_SRC_VERSION%-*}
      if [ $rebuild_criu -eq 1 ]; then
        echo "  --rebuild-criu: would build CRIU again (criu ${have[criu]:-is not installed})"
      else
        echo "  criu ${have[criu]:-is not installed}${have[criu]:+ is older than $CRIU_MIN}; $REL has ${cand_criu:-no criu}; no cached build"
      fi
      echo "  would build CRIU ${v:-(the newest version $CRIU_SOURCE_SUITE carries)} from Debian's source package in $CRIU_SOURCE_SUITE"
      echo "    (deb-src only, in the apt configuration $SRC_DIR) as ${v:-VERSION}-$CRIU_LOCAL_REVISION, profiles nocheck nodoc,"
      echo "    cache the .debs in $CACHE/criu-${v:-VERSION}-$CRIU_LOCAL_REVISION/ and install ${CRIU_PACKAGES[*]} from there"
      write_debian_dir "$tmp/criu" "${v:-$CRIU_MIN}"
      if p=$(build_dep_plan "$tmp/criu" 2>&1 && summary); then
        echo "    build dependencies from $REL: $p"
      else
        echo "    build dependencies: a real run would stop here:"; sed 's/^/    /' <<<"$p"
      fi ;;
  esac
  exit 0
fi

# ---- the work -------------------------------------------------------------------
if [ ${#next_missing[@]} -gt 0 ] && [ -n "$NEXT" ] && [ ! -f /etc/apt/sources.list.d/dvr-$NEXT.sources ]; then
  cat >/etc/apt/sources.list.d/dvr-$NEXT.sources <<SRC
Types: deb
URIs: $MIRROR
Suites: $NEXT
Components: main
Signed-By: $KEYRING
SRC
fi
if [ -f /etc/apt/sources.list.d/dvr-$NEXT.sources ]; then
  pin="# Memory DVR (install-deps.sh): take nothing from $NEXT unless asked for. Only
# the Architecture: all packages python3-scikit-build-core and python3-packaging
# are asked for (as PKG/$NEXT); nothing compiled comes from $NEXT.
Package: *
Pin: release n=$NEXT
Pin-Priority: 100"
  [ "$(cat /etc/apt/preferences.d/dvr-$NEXT-pin 2>/dev/null)" = "$pin" ] ||
    printf '%s\n' "$pin" >/etc/apt/preferences.d/dvr-$NEXT-pin
fi

say "updating apt's package lists"
run "apt-get update" "${FULL_APT[@]}" -q update

if [ ${#missing[@]} -gt 0 ]; then
  simulate "${missing[*]}" -- "${SYS_APT[@]}" install "${missing[@]}"
  say "installing from $REL: ${missing[*]}"
  run "installing ${missing[*]}" "${SYS_APT[@]}" -y install "${missing[@]}"
fi
if [ ${#next_missing[@]} -gt 0 ]; then
  if [ -n "$NEXT" ]; then
    # PKG/trixie: the package itself from trixie, its dependencies from this release
    # where it has them (-t trixie would take them from trixie too).
    simulate "${next_missing[*]}" next -- "${FULL_APT[@]}" install "${next_missing[@]/%//$NEXT}"
    say "installing from $NEXT (Architecture: all): ${next_missing[*]}: $(summary)"
    run "installing ${next_missing[*]}" "${FULL_APT[@]}" -y install "${next_missing[@]/%//$NEXT}"
  else
    simulate "${next_missing[*]}" -- "${SYS_APT[@]}" install "${next_missing[@]}"
    say "installing from $REL: ${next_missing[*]}"
    run "installing ${next_missing[*]}" "${SYS_APT[@]}" -y install "${next_missing[@]}"
  fi
fi

install_criu_debs() {  # DIR: installs the cached .debs of a CRIU build; 1 if apt cannot
  local dir=$1 debs=() p
  (cd "$dir" && sha256sum --quiet -c SHA256SUMS) >>"$LOG" 2>&1 || { say "the cache $dir is damaged"; return 1; }
  for p in "${CRIU_PACKAGES[@]}"; do debs+=("$(ls "$dir"/${p}_*.deb)"); done
  local sim
  sim=$("${SYS_APT[@]}" -s install --reinstall --allow-downgrades "${debs[@]}" 2>&1) || { echo "$sim" >>"$LOG"; return 1; }
  check_plan "CRIU from $dir" "$sim" "" downgrades
  run "installing CRIU from $dir" "${SYS_APT[@]}" -y --reinstall --allow-downgrades install "${debs[@]}"
  apt-mark auto libcompel1 libcriu2 >>"$LOG" 2>&1 || true
}

build_criu() {
  local t0=$SECONDS
  say "fetching the index of Debian's $CRIU_SOURCE_SUITE sources (deb-src only, in $SRC_DIR)"
  mkdir -p "$SRC_DIR/sources.list.d" "$SRC_DIR/empty.d" "$SRC_DIR/lists/partial" "$SRC_DIR/cache/archives/partial"
  : >"$SRC_DIR/empty.list"; : >"$SRC_DIR/empty.status"
  # deb-src only: no binary package can come from here, and the system's apt never
  # reads this configuration. The archive mirror here serves Release files that
  # apt calls expired, so their date is not checked (the signature is).
  cat >"$SRC_DIR/sources.list.d/$CRIU_SOURCE_SUITE-src.sources" <<SRC
Types: deb-src
URIs: $MIRROR
Suites: $CRIU_SOURCE_SUITE
Components: main
Signed-By: $KEYRING
Check-Valid-Until: no
SRC
  run "apt-get update ($CRIU_SOURCE_SUITE deb-src)" apt-get "${SRC_APT_OPTS[@]}" -q update
  CRIU_SRC_VERSION=$(apt-cache "${SRC_APT_OPTS[@]}" showsrc --only-source criu | sed -n 's/^Version: *//p' | newest)
  [ -n "$CRIU_SRC_VERSION" ] || die "$CRIU_SOURCE_SUITE has no source package criu"
  local upv=${CRIU_SRC_VERSION%-*}
  upv=${upv#*:}
  dpkg --compare-versions "$upv" ge "$CRIU_MIN~" || die "$CRIU_SOURCE_SUITE's criu is $CRIU_SRC_VERSION, older than $CRIU_MIN"
  local ver=$upv-$CRIU_LOCAL_REVISION
  local work=$CACHE/build-criu-$ver
  rm -rf "$work" "$CACHE/criu-$ver.new"
  mkdir -p "$work/dl"
  chown _apt:root "$work/dl" 2>/dev/null || true   # apt downloads as _apt
  # the .dsc and the upstream tarball, checked against the hashes in the signed
  # index (apt-helper) and the tarball against the .dsc
  local uris uri file size hash
  uris=$(cd "$work/dl" && apt-get "${SRC_APT_OPTS[@]}" source --print-uris --only-source "criu=$CRIU_SRC_VERSION" 2>>"$LOG" |
         grep "^'") || die "apt cannot find the source package criu $CRIU_SRC_VERSION; see $LOG"
  while read -r uri file size hash; do
    uri=${uri//\'/}
    case $file in *.dsc|*.orig.tar.*) ;; *) continue ;; esac
    run "downloading $file" /usr/lib/apt/apt-helper download-file "$uri" "$work/dl/$file" "$hash"
  done <<<"$uris"
  local dsc orig
  dsc=$(ls "$work"/dl/*.dsc) orig=$(ls "$work"/dl/*.orig.tar.*)
  local want
  want=$(awk '/^Checksums-Sha256:/ {f=1; next} /^[^ ]/ {f=0} f && $3 == n {print $1}' n="$(basename "$orig")" "$dsc")
  [ -n "$want" ] && [ "$(sha256sum <"$orig" | cut -d' ' -f1)" = "$want" ] ||
    die "$(basename "$orig") does not match the checksum in $(basename "$dsc")"
  mkdir -p "$work/src"
  tar -xf "$orig" -C "$work/src"
  local srcdir
  srcdir=$(ls -d "$work"/src/*/ | head -n1)
  srcdir=${srcdir%/}
  ln -sf "$orig" "$work/src/criu_$upv.orig.tar.${orig##*.tar.}"
  write_debian_dir "$srcdir" "$upv"

  # build dependencies, from this release only (see build_dep_plan)
  build_dep_plan "$srcdir"
  if [ -n "$PLAN" ]; then
    say "installing CRIU's build dependencies from $REL: $(summary)"
    run "installing CRIU's build dependencies" "${SYS_APT[@]}" -y --allow-downgrades build-dep -P nocheck,nodoc "$srcdir"
    # so that apt-get autoremove can take them away again
    local new=("${NEW_PKGS[@]}")
    [ ${#new[@]} -eq 0 ] || apt-mark auto "${new[@]}" >>"$LOG" 2>&1 || true
  fi
  rm -f "$tmp/prefs.d/zz-dvr-build-deps"

  local n minutes
  n=$(nproc)
  minutes=$(( (3 + n - 1) / n ))   # 2 to 3 core-minutes (53 to 88 s on 2 cores)
  say "building CRIU $upv from Debian's source package ($CRIU_SOURCE_SUITE) as $ver, about $minutes min on $n cores; log: $LOG"
  chown -R nobody:nogroup "$work"
  echo "== $(date +%T) building CRIU $ver in $srcdir as nobody" >>"$LOG"
  if ! (cd "$srcdir" && setpriv --reuid=nobody --regid=nogroup --clear-groups \
          env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$work" TMPDIR="$work" LC_ALL=C.UTF-8 \
          DEB_BUILD_OPTIONS="nocheck nodoc noddebs parallel=$n" DEB_BUILD_PROFILES="nocheck nodoc" \
          dpkg-buildpackage -b -uc -us) >>"$LOG" 2>&1; then
    say "building CRIU $ver failed; the last lines of $LOG:"
    tail -n 30 "$LOG" | cut -c1-200 | sed 's/^/  | /' >&2
    say "nothing of it was installed; the build tree is $work"
    exit 1
  fi
  # the cache: complete (SHA256SUMS written last) or absent
  mkdir -p "$CACHE/criu-$ver.new"
  local p
  for p in "${CRIU_PACKAGES[@]}"; do
    cp "$work/src/${p}_${ver}_"*.deb "$CACHE/criu-$ver.new/" || die "the build made no package $p"
  done
  (cd "$CACHE/criu-$ver.new" && sha256sum ./*.deb >SHA256SUMS)
  rm -rf "$CACHE/criu-$ver"
  mv "$CACHE/criu-$ver.new" "$CACHE/criu-$ver"
  rm -rf "$work"
  criu_cache=$CACHE/criu-$ver
  say "built CRIU $ver in $(( (SECONDS - t0) / 60 ))m$(( (SECONDS - t0) % 60 ))s; packages cached in $criu_cache"
}

case $criu_plan in
  release)
    simulate "criu from $REL" -- "${SYS_APT[@]}" install criu libcriu-dev
    say "installing criu $cand_criu and libcriu-dev from $REL"
    run "installing criu" "${SYS_APT[@]}" -y install criu libcriu-dev ;;
  cache|build)
    if [ "$criu_plan" = cache ]; then
      say "installing CRIU $(basename "$criu_cache" | sed 's/^criu-//') from the cache $criu_cache"
      install_criu_debs "$criu_cache" && criu_plan=done ||
        say "the cached packages cannot be installed here; building them again"
    fi
    if [ "$criu_plan" != done ]; then
      build_criu
      say "installing ${CRIU_PACKAGES[*]} $(basename "$criu_cache" | sed 's/^criu-//')"
      install_criu_debs "$criu_cache" || die "cannot install the CRIU packages just built; see $LOG"
    fi ;;
esac
exit 0
