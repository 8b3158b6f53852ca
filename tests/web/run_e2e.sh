#!/usr/bin/env bash
# The dashboard's end-to-end test (CTest "dashboard_e2e"): runs
# tests/web/dashboard_e2e.mjs in node, which drives Debian's headless Chromium
# against a real `dvr serve`. Prints "SKIPPED: why" and exits 0 when node,
# chromium, the built dashboard or root is missing (install-deps.sh installs
# nodejs, npm and chromium; the dvr-web target builds the dashboard).
#   run_e2e.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "${1:?usage: run_e2e.sh BUILD_DIR SOURCE_DIR}" && pwd)
src=$(cd "${2:?usage: run_e2e.sh BUILD_DIR SOURCE_DIR}" && pwd)
chromium=${CHROMIUM:-/usr/bin/chromium}
skip() { echo "SKIPPED: $*"; exit 0; }
command -v node >/dev/null || skip "node is not installed (install-deps.sh installs nodejs and npm)"
[ -x "$chromium" ] || skip "$chromium is not installed (install-deps.sh installs Debian's chromium)"
[ "$(id -u)" -eq 0 ] || skip "the clone step needs root (dvr run, CRIU)"
[ -f "$build/web/index.html" ] || skip "the dashboard is not built ($build/web/index.html; the dvr-web target builds it when npm is installed)"
[ -d "$src/web/node_modules/playwright-core" ] || skip "playwright-core is not installed in $src/web/node_modules (web/build.sh runs npm ci)"
export DVR_BIN=$build/dvr DVR_TEST_JOB=$build/dvr-test-job DVR_WEB_ROOT=$build/web DVR_PYTHONPATH=$build/python \
       DVR_WEB_DIR=$src/web DVR_E2E_SCREENSHOTS=$build/e2e-screenshots CHROMIUM=$chromium
exec node "$src/tests/web/dashboard_e2e.mjs"
