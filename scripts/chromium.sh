#!/usr/bin/env bash
# Prints the path of a headless-capable Chromium for the browser test (tests/integration/services/test_ui_browser.py),
# installing Debian's `chromium` package with apt-get when none is found.
#
#   export CKPTFLOW_CHROMIUM=$(scripts/chromium.sh)
#
# Looks at $CKPTFLOW_CHROMIUM first, then `chromium` and `chromium-browser` on PATH. The package index is
# refreshed (apt-get update) only if the install fails without it. Exits non-zero, saying why, when no
# usable binary can be had; the browser test is then skipped.
set -euo pipefail

usable() {
    # A binary that exists and answers --version (a broken install or a snap stub does not).
    [ -n "$1" ] && [ -x "$1" ] && "$1" --version >/dev/null 2>&1
}

find_chromium() {
    local candidate
    for candidate in "${CKPTFLOW_CHROMIUM:-}" "$(command -v chromium || true)" \
        "$(command -v chromium-browser || true)"; do
        if usable "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

install_chromium() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "chromium.sh: chromium not found and apt-get is unavailable; install Chromium and set CKPTFLOW_CHROMIUM" >&2
        return 1
    fi
    echo "chromium.sh: chromium not found; installing the Debian package" >&2
    local install=(apt-get install -y --no-install-recommends chromium)
    if DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2; then
        return 0
    fi
    echo "chromium.sh: install failed; refreshing the package index and retrying" >&2
    apt-get update >&2 && DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2
}

if find_chromium; then
    exit 0
fi
if install_chromium && find_chromium; then
    exit 0
fi
echo "chromium.sh: no usable chromium (tried \$CKPTFLOW_CHROMIUM, chromium, chromium-browser, apt-get install chromium)" >&2
exit 1
