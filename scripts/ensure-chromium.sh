#!/bin/sh
# Make Debian's chromium available for the live page's browser test
# (tests/e2e/test_dashboard.py drives it through Playwright). Installs it with
# apt-get only when /usr/bin/chromium is missing; never `playwright install`,
# which downloads a browser build of its own.
set -eu

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-chromium: $CHROMIUM is missing; install it as root: apt-get install chromium" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-chromium: $CHROMIUM is missing and there is no apt-get here" >&2
    exit 1
fi

echo "ensure-chromium: installing Debian's chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
test -x "$CHROMIUM"
echo "ensure-chromium: $("$CHROMIUM" --version 2>/dev/null)"
