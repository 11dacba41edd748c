#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ on localhost if they are down (the machine normally starts them).
set -u
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {
  for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 1; done
  echo "ensure_services: $2 did not come up on port $1" >&2; return 1
}
status=0
if ! port_open 5432; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  wait_port 5432 PostgreSQL || status=1
fi
if ! port_open 6379; then
  echo "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  wait_port 6379 Redis || status=1
fi
if ! port_open 5672; then
  echo "starting RabbitMQ"
  rabbitmq-server -detached || true
  wait_port 5672 RabbitMQ || status=1
fi
exit $status
