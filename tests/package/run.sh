#!/usr/bin/env bash
# Installs a build tree into a fresh prefix and uses it from outside, as a
# project that never saw the source tree would (docs/cmake.md):
#   1. cmake --install BUILD --prefix TMP; the expected files are there and the
#      exported dvr::dvr carries no private dependency;
#   2. tests/package/consumer (find_package(dvr), dvr::dvr) configured with
#      -DCMAKE_PREFIX_PATH=TMP, built and run (snapshot + restore of a buffer);
#      consumer_c too when dvr/dvr.h is installed;
#   3. the same main.cpp built with g++ $(pkg-config --cflags --libs dvr) and run
#      (consumer.c with gcc too when dvr/dvr.h is installed);
#   4. when the build has dvr_mpi: tests/package/consumer/mpi
#      (find_package(dvr COMPONENTS mpi), dvr::mpi) and the same sources with
#      pkg-config dvr_mpi, C++ and C, each run on 2 MPI ranks (skipped, saying
#      why, when MPI is not installed);
#   5. the installed headers compile on their own (C99 for dvr.h, export.h
#      and dvr_mpi.h; C++20 for the rest), and every function they declare for
#      the library to define is DVR_EXPORT (check_exports.py, with clang);
#   6. TMP/bin/dvr --version, and `dvr proc check --json` finds the CRIU plugin
#      under TMP when the build has one.
#
#   tests/package/run.sh BUILD_DIR LIBDIR VERSION [PLUGIN_BUILT(0|1)] [MPI_BUILT(0|1)]
# (CTest test `package`, tests/CMakeLists.txt, passes all five; MPI_BUILT
# defaults to whether BUILD_DIR/libdvr has libdvr_mpi.so.)
set -euo pipefail

build=$(cd "${1:?usage: run.sh BUILD_DIR LIBDIR VERSION [PLUGIN_BUILT] [MPI_BUILT]}" && pwd)
libdir=${2:?LIBDIR (CMAKE_INSTALL_LIBDIR, e.g. lib)}
version=${3:?VERSION (project version, e.g. 0.1.0)}
plugin_built=${4:-0}
if [[ -n ${5:-} ]]; then
  mpi_built=$5
elif [[ -e $build/libdvr/libdvr_mpi.so ]]; then
  mpi_built=1
else
  mpi_built=0
fi
here=$(cd "$(dirname "$0")" && pwd)
# Whatever is found must come from the prefix: RPATHs and the flags given here.
unset LD_LIBRARY_PATH
cmake=${CMAKE:-cmake}  # CTest passes the cmake that configured the build

tmp=$(mktemp -d /tmp/dvr-package.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "package: FAIL: $*" >&2; exit 1; }
# loads_dvr_from_prefix [ldd output]: libdvr.so.0 resolves to the installed one.
loads_dvr_from_prefix() {
  local lib
  lib=$(sed -n 's/^[[:space:]]*libdvr\.so\.0 => \([^ ]*\) .*/\1/p' <<<"$1")
  [[ -n $lib && $lib -ef $prefix/$libdir/libdvr.so.0 ]] || { echo "$1" >&2; return 1; }
}
# loads_dvr_mpi_from_prefix [ldd output]: libdvr_mpi.so.0 and libdvr.so.0 both
# resolve to the installed ones.
loads_dvr_mpi_from_prefix() {
  local lib
  lib=$(sed -n 's/^[[:space:]]*libdvr_mpi\.so\.0 => \([^ ]*\) .*/\1/p' <<<"$1")
  [[ -n $lib && $lib -ef $prefix/$libdir/libdvr_mpi.so.0 ]] || { echo "$1" >&2; return 1; }
  loads_dvr_from_prefix "$1"
}
step() { echo "== $*"; }

step "cmake --install $build --prefix $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install failed"; }

step "installed files"
for f in bin/dvr "$libdir/libdvr.so" "$libdir/libdvr.so.0" "$libdir/libdvr.so.$version" \
         include/dvr/dvr.hpp "$libdir/cmake/dvr/dvrConfig.cmake" "$libdir/cmake/dvr/dvrConfigVersion.cmake" \
         "$libdir/cmake/dvr/dvrTargets.cmake" "$libdir/pkgconfig/dvr.pc" share/bash-completion/completions/dvr \
         "$libdir/dvr/libdvr_init.so"; do
  [[ -e $prefix/$f ]] || fail "$prefix/$f is not installed"
done
for h in "$here"/../../libdvr/include/dvr/*.hpp "$here"/../../libdvr/include/dvr/*.h; do
  [[ -e $h ]] || continue
  [[ -e $prefix/include/dvr/$(basename "$h") ]] || fail "public header $(basename "$h") is not installed"
done
# Nothing of the python component (the wheel's files) in a default install.
[[ ! -e $prefix/memdvr ]] || fail "the python component was installed by a default cmake --install"
# The exported target: only the include dir and C++20, no private dependency.
if grep -E 'pmem2|xxhash|zstd|sodium|Threads|PkgConfig::' "$prefix/$libdir"/cmake/dvr/dvrTargets*.cmake; then
  fail "dvrTargets*.cmake names a private dependency of libdvr (above)"
fi
grep -q 'INTERFACE_COMPILE_FEATURES "cxx_std_20"' "$prefix/$libdir/cmake/dvr/dvrTargets.cmake" \
  || fail "dvr::dvr does not carry cxx_std_20"
if [[ $mpi_built == 1 ]]; then
  for f in "$libdir/libdvr_mpi.so" "$libdir/libdvr_mpi.so.0" "$libdir/libdvr_mpi.so.$version" \
           include/dvr/mpi.hpp include/dvr/dvr_mpi.h "$libdir/cmake/dvr/dvrMpiTargets.cmake" "$libdir/pkgconfig/dvr_mpi.pc"; do
    [[ -e $prefix/$f ]] || fail "the build has dvr_mpi, but $prefix/$f is not installed"
  done
  # dvr::mpi: dvr::dvr and MPI, nothing private of libdvr.
  if grep -E 'pmem2|xxhash|zstd|PkgConfig::' "$prefix/$libdir"/cmake/dvr/dvrMpiTargets*.cmake; then
    fail "dvrMpiTargets*.cmake names a private dependency of libdvr (above)"
  fi
  grep -q 'INTERFACE_LINK_LIBRARIES "dvr::dvr;MPI::MPI_CXX"' "$prefix/$libdir/cmake/dvr/dvrMpiTargets.cmake" \
    || fail "dvr::mpi does not link dvr::dvr and MPI::MPI_CXX"
  # The installed libdvr_mpi finds the libdvr beside it by itself ($ORIGIN).
  loads_dvr_from_prefix "$(ldd "$prefix/$libdir/libdvr_mpi.so.0")" \
    || fail "the installed libdvr_mpi.so does not load libdvr from $prefix/$libdir"
fi
# libdvr.so exports the public API only (-fvisibility=hidden, DVR_EXPORT).
internals=$(nm -D --defined-only "$prefix/$libdir/libdvr.so" | c++filt | grep -c 'dvr::detail' || true)
[[ $internals == 0 ]] || fail "the installed libdvr.so exports $internals symbols of dvr::detail"
echo "libdvr.so exports no dvr::detail symbol: ok"

step "find_package(dvr) consumer"
"$cmake" -S "$here/consumer" -B "$tmp/consumer-build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DDVR_EXPECTED_VERSION="$version" -DDVR_EXPECT_MPI="$mpi_built" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF
found=$(sed -n 's/^dvr_DIR:PATH=//p' "$tmp/consumer-build/CMakeCache.txt")
[[ $found == "$prefix/$libdir/cmake/dvr" ]] || fail "find_package(dvr) found $found, not the one under $prefix"
"$cmake" --build "$tmp/consumer-build"
# No LD_LIBRARY_PATH: CMake gives the consumer a build RPATH to the imported libdvr.so.
loads_dvr_from_prefix "$(ldd "$tmp/consumer-build/consumer")" \
  || fail "consumer does not load libdvr from $prefix/$libdir"
"$tmp/consumer-build/consumer" "$tmp/store-cmake" "$version"
if [[ -e $prefix/include/dvr/dvr.h ]]; then
  [[ -x $tmp/consumer-build/consumer_c ]] || fail "dvr/dvr.h is installed but consumer_c was not built"
  "$tmp/consumer-build/consumer_c" "$tmp/store-c" "$version"
else
  echo "dvr/dvr.h not installed: the C consumer is skipped"
fi

# dvrConfigVersion.cmake (SameMajorVersion): the next major version is refused.
next_major=$(( ${version%%.*} + 1 )).0
if "$cmake" -S "$here/consumer" -B "$tmp/consumer-next" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
     -DDVR_EXPECTED_VERSION="$next_major" >"$tmp/consumer-next.log" 2>&1; then
  fail "find_package(dvr $next_major) accepted dvr $version"
fi
grep -q "dvrConfig.cmake, version: $version" "$tmp/consumer-next.log" \
  || { cat "$tmp/consumer-next.log"; fail "find_package(dvr $next_major) failed for another reason than the version"; }
echo "find_package(dvr $next_major) refuses dvr $version: ok"

step "pkg-config consumer"
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
[[ $(pkg-config --modversion dvr) == "$version" ]] || fail "pkg-config --modversion dvr: $(pkg-config --modversion dvr), expected $version"
[[ $(pkg-config --variable=prefix dvr) -ef $prefix ]] || fail "dvr.pc: prefix $(pkg-config --variable=prefix dvr) is not $prefix"
pkg-config --libs --static dvr | grep -q -- -lpmem2 || fail "pkg-config --static --libs dvr lacks the private libraries"
flags=$(pkg-config --cflags --libs dvr)
echo "pkg-config --cflags --libs dvr: $flags"
# shellcheck disable=SC2086  # word splitting of the flags is the point
g++ -std=c++20 -o "$tmp/consumer-pc" "$here/consumer/main.cpp" $flags
loads_dvr_from_prefix "$(LD_LIBRARY_PATH=$prefix/$libdir ldd "$tmp/consumer-pc")" \
  || fail "consumer-pc does not load libdvr from $prefix/$libdir"
LD_LIBRARY_PATH=$prefix/$libdir "$tmp/consumer-pc" "$tmp/store-pc" "$version"
if [[ -e $prefix/include/dvr/dvr.h ]]; then
  # shellcheck disable=SC2086
  gcc -std=c11 -o "$tmp/consumer-pc-c" "$here/consumer/consumer.c" $flags
  LD_LIBRARY_PATH=$prefix/$libdir "$tmp/consumer-pc-c" "$tmp/store-pc-c" "$version"
fi

step "installed headers"
# Each on its own: the C headers as C99 (export.h and dvr.h; dvr_mpi.h with
# MPI's flags from dvr_mpi.pc), the C++ headers as C++20, warnings as errors.
mpi_cflags=""
[[ $mpi_built == 1 ]] && mpi_cflags=$(pkg-config --cflags dvr_mpi)
for h in "$prefix"/include/dvr/*.h "$prefix"/include/dvr/*.hpp; do
  name=$(basename "$h")
  flags=(-I"$prefix/include")
  case $name in
    dvr_mpi.h|mpi.hpp)
      [[ $mpi_built == 1 ]] || continue
      # shellcheck disable=SC2206  # the flags, split
      flags+=($mpi_cflags) ;;
  esac
  case $name in
    *.h) printf '#include <dvr/%s>\nint main(void) { return 0; }\n' "$name" >"$tmp/header.c"
         gcc -std=c99 -Wall -Wextra -pedantic -Werror -fsyntax-only "${flags[@]}" "$tmp/header.c" \
           || fail "installed header dvr/$name does not compile as C99 on its own" ;;
    *) printf '#include <dvr/%s>\nint main() { return 0; }\n' "$name" >"$tmp/header.cpp"
       g++ -std=c++20 -Wall -Wextra -Werror -fsyntax-only "${flags[@]}" "$tmp/header.cpp" \
         || fail "installed header dvr/$name does not compile as C++20 on its own" ;;
  esac
  echo "dvr/$name compiles on its own"
done
headers=()
for h in "$prefix"/include/dvr/*.h "$prefix"/include/dvr/*.hpp; do
  name=$(basename "$h")
  [[ $mpi_built == 1 || ( $name != dvr_mpi.h && $name != mpi.hpp ) ]] && headers+=("$name")
done
# shellcheck disable=SC2086
rc=0; python3 "$here/check_exports.py" "$prefix/include" "${headers[@]}" -- $mpi_cflags || rc=$?
[[ $rc == 0 || $rc == 77 ]] || fail "a function of the public headers is not DVR_EXPORT (above)"

step "MPI consumers (find_package(dvr COMPONENTS mpi), pkg-config dvr_mpi)"
if [[ $mpi_built != 1 ]]; then
  echo "the build has no dvr_mpi (MPI was not found when it was configured): the MPI consumers are skipped"
elif ! command -v mpirun >/dev/null; then
  echo "mpirun is not installed (Debian: openmpi-bin): the MPI consumers are skipped"
else
  mpirun=(mpirun)
  # OpenMPI: 2 ranks on any machine (--oversubscribe), as root too
  # (containers), shared memory only, its segments in $tmp.
  if mpirun --version 2>/dev/null | grep -q -E 'Open MPI|OpenRTE'; then
    mpirun+=(--allow-run-as-root --oversubscribe --mca btl self,vader --mca btl_vader_backing_directory "$tmp")
  fi
  "$cmake" -S "$here/consumer/mpi" -B "$tmp/consumer-mpi-build" -G Ninja \
    -DCMAKE_PREFIX_PATH="$prefix" -DDVR_EXPECTED_VERSION="$version" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF
  found=$(sed -n 's/^dvr_DIR:PATH=//p' "$tmp/consumer-mpi-build/CMakeCache.txt")
  [[ $found == "$prefix/$libdir/cmake/dvr" ]] || fail "find_package(dvr COMPONENTS mpi) found $found, not the one under $prefix"
  "$cmake" --build "$tmp/consumer-mpi-build"
  for exe in consumer_mpi consumer_mpi_c; do
    loads_dvr_mpi_from_prefix "$(ldd "$tmp/consumer-mpi-build/$exe")" \
      || fail "$exe does not load libdvr_mpi and libdvr from $prefix/$libdir"
    "${mpirun[@]}" -np 2 "$tmp/consumer-mpi-build/$exe" "$tmp/store-mpi-cmake-$exe" "$version" \
      || fail "$exe (find_package(dvr COMPONENTS mpi)) failed on 2 ranks"
  done

  [[ $(pkg-config --modversion dvr_mpi) == "$version" ]] \
    || fail "pkg-config --modversion dvr_mpi: $(pkg-config --modversion dvr_mpi), expected $version"
  mpi_flags=$(pkg-config --cflags --libs dvr_mpi)
  echo "pkg-config --cflags --libs dvr_mpi: $mpi_flags"
  # Plain g++/gcc: dvr_mpi.pc carries MPI's flags too (mpicxx/mpicc would do as well).
  # shellcheck disable=SC2086
  g++ -std=c++20 -o "$tmp/consumer-mpi-pc" "$here/consumer/mpi/mpi_main.cpp" $mpi_flags -Wl,-rpath,"$prefix/$libdir"
  # shellcheck disable=SC2086
  gcc -std=c11 -o "$tmp/consumer-mpi-pc-c" "$here/consumer/mpi/mpi_consumer.c" $mpi_flags -Wl,-rpath,"$prefix/$libdir"
  for exe in consumer-mpi-pc consumer-mpi-pc-c; do
    loads_dvr_mpi_from_prefix "$(ldd "$tmp/$exe")" || fail "$exe does not load libdvr_mpi and libdvr from $prefix/$libdir"
    "${mpirun[@]}" -np 2 "$tmp/$exe" "$tmp/store-$exe" "$version" || fail "$exe (pkg-config dvr_mpi) failed on 2 ranks"
  done
fi

step "installed dvr command"
out=$("$prefix/bin/dvr" --version)
[[ $out == "dvr $version" ]] || fail "$prefix/bin/dvr --version printed '$out', expected 'dvr $version'"
echo "$out"
loads_dvr_from_prefix "$(ldd "$prefix/bin/dvr")" \
  || fail "the installed dvr does not load libdvr from $prefix/$libdir"
if [[ $plugin_built == 1 ]]; then
  [[ -e $prefix/$libdir/dvr/criu/dvr_criu.so ]] || fail "the CRIU plugin is not installed in $prefix/$libdir/dvr/criu"
  # Exit 1 only says CRIU is not ready here (no root, old kernel ...); the plugin
  # path is what is checked. DVR_CRIU_PLUGIN_DIR would override the search.
  check=$(env -u DVR_CRIU_PLUGIN_DIR "$prefix/bin/dvr" proc check --json) || true
  echo "dvr proc check --json: $check"
  plugin=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["plugin"])' "$check")
  [[ -n $plugin && $plugin -ef $prefix/$libdir/dvr/criu/dvr_criu.so ]] || fail "dvr proc check found the plugin at '$plugin', not under $prefix"
else
  echo "the CRIU plugin was not built (no libcriu-dev): not checked"
fi
echo "package: ok"
