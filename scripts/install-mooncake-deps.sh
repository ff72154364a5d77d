#!/usr/bin/env bash
# Shared libraries that the Mooncake Transfer Engine wheel (the `mooncake` extra) loads even
# when it only speaks TCP, the C compiler that builds ARK's connect() interposer
# (ark.integrations.preload), and the verbs headers that ARK's verbs interposer is compiled
# against (libibverbs-dev: <infiniband/verbs.h>, ark.integrations.verbs). Debian/Ubuntu; needs
# root. Idempotent: installs only what is missing, and skips apt when everything is there.
set -euo pipefail
pkgs=(libibverbs1 libibverbs-dev libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 gcc libc6-dev)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-mooncake-deps: missing ${missing[*]}; run as root (apt-get install)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-mooncake-deps: installed ${missing[*]}"
