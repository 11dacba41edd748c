#!/usr/bin/env bash
# Install the command-line tools the test suite needs beyond Python packages, if they are missing:
# promtool (Debian's `prometheus` package) for checking and unit-testing ops/alerts.yml.
# The package's service is never started: policy-rc.d refuses it for the duration of the install.
set -eu
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "ensure_tools: installing promtool (Debian package prometheus)"
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
policy=/usr/sbin/policy-rc.d
own_policy=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo_cmd tee "$policy" >/dev/null
  $sudo_cmd chmod +x "$policy"
  own_policy=1
fi
cleanup() { [ -z "$own_policy" ] || $sudo_cmd rm -f "$policy"; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get install -y -q --no-install-recommends prometheus >/dev/null \
  || { $sudo_cmd apt-get update -q >/dev/null && $sudo_cmd apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
command -v promtool >/dev/null
