#!/usr/bin/env bash
# Screenshot of a `novatune report` HTML page with headless Chromium (Debian: apt-get install -y chromium).
#   scripts/screenshot_report.sh REPORT.html OUT.png [WIDTH] [HEIGHT]
# The page is self-contained (images embedded), so no network is needed; a tall window catches the whole report.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 REPORT.html OUT.png [WIDTH=1200] [HEIGHT=6000]" >&2
  exit 2
fi
html=$(realpath "$1")
out=$(realpath -m "$2")
width=${3:-1200}
height=${4:-6000}
browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
if [ -z "$browser" ]; then
  echo "no chromium found: apt-get install -y chromium (or set CHROMIUM=/path/to/browser)" >&2
  exit 3
fi
# a throwaway profile: the browser writes nothing into the user's home; --no-sandbox because CI runs as root.
# All network goes to a dead proxy: anything the page tried to fetch would show up missing in the screenshot.
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
  --proxy-server=127.0.0.1:9 --proxy-bypass-list="<-loopback>" \
  --window-size="$width,$height" --screenshot="$out" "file://$html" >/dev/null 2>&1
[ -s "$out" ] || { echo "chromium wrote no screenshot to $out" >&2; exit 1; }
echo "$out"
