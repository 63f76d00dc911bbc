#!/usr/bin/env bash
# Installs headless Chromium (Debian's `chromium` package) for tests/api/test_view_browser.py, if it is missing.
# Needs root (or passwordless sudo) and the Debian package mirrors; does nothing when /usr/bin/chromium exists.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo -n"
  else
    echo "chromium.sh: not root and no sudo; tests/api/test_view_browser.py will skip" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
