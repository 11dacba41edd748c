#!/usr/bin/env bash
# Start, restart or stop a PostgreSQL cluster of the stack's own (initdb + pg_ctl) on 127.0.0.1.
#
#   PG_PASSWORD=... postgres.sh start DIR PORT   # initdb (superuser postgres, that password) if DIR has no cluster
#   postgres.sh restart DIR                      # pg_ctl restart -m fast (the soak's postgres-restart fault)
#   postgres.sh stop DIR                         # pg_ctl stop -m fast, immediate if that hangs
#
# Binaries: PG_BIN, else the newest /usr/lib/postgresql/*/bin, else `pg_config --bindir`. As root the cluster
# runs as the user postgres (the server refuses root): DIR is handed to that user. TCP takes the password
# (scram-sha-256); the Unix socket lives in DIR. Data, log and the server's pid file live in DIR.
set -euo pipefail

usage() { echo "usage: $0 start DIR PORT | restart DIR | stop DIR" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1 dir=$2 port=${3:-}

bin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
[[ -n "$bin" ]] || bin=$(pg_config --bindir 2>/dev/null || true)
[[ -x "$bin/pg_ctl" ]] || { echo "no PostgreSQL server binaries (initdb, pg_ctl) found; set PG_BIN" >&2; exit 1; }
as_owner=()
if [[ $EUID -eq 0 ]]; then as_owner=(runuser -u postgres --); fi
ctl() { "${as_owner[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" "$@"; }

start() {
  [[ -n "$port" ]] || usage
  mkdir -p "$dir"
  chmod 700 "$dir"
  if [[ $EUID -eq 0 ]]; then chown postgres: "$dir"; fi
  if [[ ! -f "$dir/data/PG_VERSION" ]]; then
    local pwfile="$dir/pwfile"
    (umask 077; printf '%s\n' "${PG_PASSWORD:?set PG_PASSWORD to the password of the superuser}" > "$pwfile")
    if [[ $EUID -eq 0 ]]; then chown postgres: "$pwfile"; fi
    "${as_owner[@]}" "$bin/initdb" -D "$dir/data" -U postgres --pwfile="$pwfile" --auth-host=scram-sha-256 \
      --auth-local=peer -E UTF8 > "$dir/initdb.log" 2>&1 || { rm -f "$pwfile"; cat "$dir/initdb.log" >&2; exit 1; }
    rm -f "$pwfile"
  fi
  ctl -w -t 60 start -o "-p $port -k $dir -c listen_addresses=127.0.0.1" > /dev/null \
    || { echo "PostgreSQL did not start; see $dir/postgres.log:" >&2; tail -20 "$dir/postgres.log" >&2; exit 1; }
  echo "PostgreSQL: 127.0.0.1:$port"
}

stop() {
  [[ -f "$dir/data/postmaster.pid" ]] || return 0
  ctl -w -t 30 -m fast stop > /dev/null 2>&1 || ctl -w -t 30 -m immediate stop > /dev/null
}

case $action in
  start) start ;;
  restart) ctl -w -t 60 -m fast restart > /dev/null ;;
  stop) stop ;;
  *) usage ;;
esac
