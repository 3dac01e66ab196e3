#!/usr/bin/env bash
# The oldest supported PostgreSQL major, 15 (Debian's postgresql-15), beside the suite's embedded 18: a
# throw-away cluster, and the suites that exercise every statement of the data path run against it
# (test/support/globalSetup.ts takes DATABASE_URL as its server). Installed when absent.
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=/usr/lib/postgresql/15/bin
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if [ ! -x "$BIN/postgres" ]; then
  # No main cluster: this script makes its own, and nothing should listen on 5432 after it.
  $SUDO mkdir -p /etc/postgresql-common/createcluster.d
  echo 'create_main_cluster = false' | $SUDO tee /etc/postgresql-common/createcluster.d/outboxd-ci.conf >/dev/null
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 >/dev/null
fi

# initdb and postgres refuse root: the cluster belongs to the postgres user then.
AS=()
DIR=$(mktemp -d)
if [ "$(id -u)" = 0 ]; then
  chown postgres "$DIR"
  AS=(runuser -u postgres --)
fi
PORT=$(node -e 'const s = require("node:net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })')
PASSWORD=outboxd-ci-$RANDOM
stop() {
  "${AS[@]}" "$BIN/pg_ctl" -D "$DIR/data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap stop EXIT
echo "$PASSWORD" >"$DIR/pw" && chmod 644 "$DIR/pw"
# The superuser is not named like outboxd's schema: search_path's "$user" would resolve to it.
"${AS[@]}" "$BIN/initdb" -D "$DIR/data" -U postgres --auth=scram-sha-256 --pwfile="$DIR/pw" >/dev/null
"${AS[@]}" "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/postgres.log" -w start \
  -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" >/dev/null
echo "PostgreSQL $("$BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PORT"

# Every statement of the data path runs in these (requests, relay, claims, outcomes, settlements, migrations,
# a replica process, PgBouncer, retention, the settlement wake's registration and triggers): the rest of
# the suite adds cases, not statements, and minutes.
DATABASE_URL="postgres://postgres:$PASSWORD@127.0.0.1:$PORT/postgres" npx vitest run \
  test/database/library.test.ts test/database/batchPlans.test.ts test/processes/pooler.test.ts test/processes/upgrade.test.ts test/processes/applicationLocks.test.ts test/processes/migrate.test.ts test/database/timeouts.test.ts \
  test/processes/settlementWake.test.ts test/processes/retention.test.ts
