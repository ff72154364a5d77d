#!/usr/bin/env bash
# What scripts/site-check.py --browser needs beyond the docs extra (selenium): Debian's
# Chromium and its ChromeDriver. As root; does nothing when both are there.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
