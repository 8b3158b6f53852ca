#!/usr/bin/env bash
# web/build.sh OUTDIR: builds the dashboard into OUTDIR (CMake's dvr-web target
# runs it with ${build}/web, where `dvr serve` finds it by default).
# Installs the pinned dependencies of package-lock.json first with `npm ci`,
# skipped when node_modules was installed from this very lock file (a stamp of
# its SHA-256). Quiet unless something fails. Needs node >= 18 and npm.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:?usage: web/build.sh OUTDIR}
case $out in /*) ;; *) out=$OLDPWD/$out ;; esac
# one install at a time (two build directories may build at once)
exec 9<package-lock.json
flock 9
stamp=node_modules/.dvr-package-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  log=$(mktemp)
  if ! npm ci --no-audit --no-fund --loglevel=error >"$log" 2>&1; then
    echo "web/build.sh: npm ci failed (it needs the npm registry, or a filled npm cache):" >&2
    tail -n 30 "$log" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
  echo "$want" >"$stamp"
fi
node_modules/.bin/tsc --noEmit -p .
DVR_WEB_OUT=$out node_modules/.bin/vite build --logLevel warn
