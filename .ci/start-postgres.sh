#!/usr/bin/env bash
# Installs (Debian's package) and starts a local PostgreSQL server for the catalog test suite, and creates
# the role and database the tests use. Idempotent. Prints the catalog URL on its last line.
set -euo pipefail
if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq postgresql >/dev/null
fi
ver=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -q "^$ver main$"; then
  pg_createcluster "$ver" main >/dev/null
fi
pg_ctlcluster "$ver" main start 2>/dev/null || true
for _ in $(seq 1 50); do
  pg_isready -q -h 127.0.0.1 -p 5432 && break
  sleep 0.2
done
pg_isready -h 127.0.0.1 -p 5432 >/dev/null
su postgres -c "psql -qtAc \"SELECT 1 FROM pg_roles WHERE rolname='mergepipe'\"" | grep -q 1 ||
  su postgres -c "psql -qc \"CREATE ROLE mergepipe LOGIN SUPERUSER PASSWORD 'mergepipe'\""
su postgres -c "psql -qtAc \"SELECT 1 FROM pg_database WHERE datname='mergepipe_test'\"" | grep -q 1 ||
  su postgres -c "psql -qc 'CREATE DATABASE mergepipe_test OWNER mergepipe'"
echo "postgresql+psycopg://mergepipe:mergepipe@127.0.0.1:5432/mergepipe_test"
