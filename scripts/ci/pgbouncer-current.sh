#!/usr/bin/env bash
# PgBouncer as Debian ships it now (trixie: 1.24), beside bookworm's 1.18, for test/processes/pooler.test.ts:
# managed poolers run a release >= 1.21 with max_prepared_statements, which bookworm does not package. Its
# own Debian root (debootstrap --variant=minbase trixie --include=pgbouncer, about a minute and 300 MB),
# kept under /var/cache/outboxd so a machine makes it once; the test runs the binary in it with chroot,
# on the host's network. Root only (debootstrap, chroot). Prints the version.
#   scripts/ci/pgbouncer-current.sh [ROOT]    (ROOT defaults to OUTBOXD_PGBOUNCER_ROOT, then the cache)
set -euo pipefail
root="${1:-${OUTBOXD_PGBOUNCER_ROOT:-/var/cache/outboxd/pgbouncer-trixie}}"

if [ -x "$root/usr/sbin/pgbouncer" ]; then
  chroot "$root" /usr/sbin/pgbouncer --version | head -n1
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

# The first Debian mirror the host's apt is configured with (deb822 .sources or one-line .list), as
# deploy/base-image/build.sh reads it.
mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
  | grep -v '^\s*#' | grep -oE 'https?://[^ ]*/debian/?' | grep -v -- '-security' | head -n1 || true)"
mirror="${mirror:-http://deb.debian.org/debian}"
# Made beside its final place and moved there whole: an interrupted run leaves no half root behind.
partial="$root.partial"
rm -rf "$partial"
mkdir -p "$(dirname "$root")"
echo "debootstrap trixie with pgbouncer from $mirror into $root"
if ! debootstrap --variant=minbase --include=pgbouncer trixie "$partial" "$mirror" >"$partial.log" 2>&1; then
  tail -n 30 "$partial.log" >&2
  exit 1
fi
rm -rf "$partial/var/cache/apt/archives/"*.deb "$partial.log"
mv "$partial" "$root"
chroot "$root" /usr/sbin/pgbouncer --version | head -n1
