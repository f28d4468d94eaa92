#!/usr/bin/env bash
# Installs berth's build dependencies from Debian/Ubuntu packages, then what the tests need
# (below; skipped with --build-only, as scripts/demo.sh runs it). Idempotent: packages that are
# already installed are skipped, so a second run does nothing and needs no network.
set -euo pipefail
build_only=0
for a in "$@"; do
  case $a in
    --build-only) build_only=1 ;;
    *) echo "setup: unknown argument '$a' (expected --build-only)" >&2; exit 2 ;;
  esac
done
pkgs=(build-essential cmake ninja-build pkg-config ccache
      libtbb-dev libhwloc-dev liburing-dev libhwy-dev libspdlog-dev libfmt-dev
      doctest-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libcpp-httplib-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all build dependencies are installed"
fi

((build_only)) && exit 0

# The official OpenAI client library the server tests round-trip with (tests/server/openai-client):
# `npm ci` from the committed lockfile, skipped when node_modules already holds that lockfile's
# install (a stamp copy of it), so a second run needs no network. Node.js and npm come from
# Debian when the machine has none.
root=$(cd "$(dirname "$0")/.." && pwd)
client=$root/tests/server/openai-client
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  echo "setup: installing nodejs npm"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends nodejs npm
fi
if cmp -s "$client/package-lock.json" "$client/node_modules/.berth-lock"; then
  echo "setup: the OpenAI client library is installed"
else
  echo "setup: npm ci in tests/server/openai-client"
  (cd "$client" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$client/package-lock.json" "$client/node_modules/.berth-lock"
fi
