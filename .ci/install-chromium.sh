#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium for the browser test of the audit report
# (tests/audit/test_report_browser.py), the way .ci/start-postgres.sh installs PostgreSQL. Idempotent.
# Without root or apt-get it installs nothing and says so: the test then skips with that reason unless CI
# is set (on CI a missing browser fails the test).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: chromium missing and not root/no apt-get: the browser test will skip (or fail on CI)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
