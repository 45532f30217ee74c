#!/usr/bin/env bash
# A local 3-node Redis Cluster for KVGate replicas ([cache.remote] cluster = true). See --help.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: loadtest/redis_cluster.sh start DIR [PORT1 PORT2 PORT3]
       loadtest/redis_cluster.sh stop DIR
       loadtest/redis_cluster.sh clean DIR
       loadtest/redis_cluster.sh status DIR
       loadtest/redis_cluster.sh -h|--help

start   starts three `redis-server --cluster-enabled yes` on 127.0.0.1 (default ports 7001 7002
        7003; each also needs PORT+10000 free, the cluster bus), one folder each under DIR
        (DIR/node-PORT: nodes.conf, redis.pid, redis.log), joins them with
        `redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes` and waits for
        cluster_state:ok on every node. A DIR that already holds the three nodes' nodes.conf is
        restarted as it was (no create). Prints the [cache.remote] lines for kvgate.toml.
stop    stops the nodes whose redis.pid files are under DIR (SIGTERM, SIGKILL after 10 s);
        their folders stay, so `start DIR` restarts the same cluster
clean   stop, then remove what start wrote (DIR/node-*, DIR/create.log) and DIR if it is then
        empty; nothing else in DIR is touched
status  prints `cluster info` of each node under DIR

The nodes run with cluster-require-full-coverage no (the live nodes keep serving their slots
when one dies: a cache prefers partial hits to none), cluster-node-timeout 2000 ms, no
persistence, and protected mode on loopback. Without replicas a dead node's slots stay
unreachable until it comes back; KVGate then counts errors, opens its circuit breaker and
recomputes (docs/deploy.md).

environment: REDIS_SERVER, REDIS_CLI (default: from PATH), CLUSTER_TIMEOUT_S (default 30)

exit status: 0 ok; 1 a node did not start or the cluster did not reach cluster_state:ok;
  2 bad usage.

example:
  loadtest/redis_cluster.sh start /tmp/kvgate-cluster 7001 7002 7003
  kvgate serve --config kvgate.toml     # [cache.remote] url = "redis://127.0.0.1:7001", cluster = true
  loadtest/redis_cluster.sh clean /tmp/kvgate-cluster
EOF
}

REDIS_SERVER=${REDIS_SERVER:-redis-server}
REDIS_CLI=${REDIS_CLI:-redis-cli}
TIMEOUT_S=${CLUSTER_TIMEOUT_S:-30}

die_usage() { echo "redis_cluster.sh: $*" >&2; echo "try: loadtest/redis_cluster.sh --help" >&2; exit 2; }
fail() { echo "redis_cluster.sh: $*" >&2; exit 1; }

node_dirs() { compgen -G "$1/node-*" || true; }  # one per line

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start_node() {  # DIR PORT
  local folder=$1/node-$2
  mkdir -p "$folder"
  "$REDIS_SERVER" --port "$2" --bind 127.0.0.1 --protected-mode yes \
    --cluster-enabled yes --cluster-config-file "$folder/nodes.conf" \
    --cluster-node-timeout 2000 --cluster-require-full-coverage no \
    --save "" --appendonly no --dir "$folder" \
    --daemonize yes --pidfile "$folder/redis.pid" --logfile "$folder/redis.log" >/dev/null \
    || fail "redis-server on port $2 did not start (see $folder/redis.log)"
}

wait_for() {  # DESCRIPTION COMMAND...: retry COMMAND every 0.1 s until it succeeds or time runs out
  local what=$1 deadline=$((SECONDS + TIMEOUT_S))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$what: not within ${TIMEOUT_S} s"
    sleep 0.1
  done
}

pong() { [[ $("$REDIS_CLI" -p "$1" ping 2>/dev/null) == PONG ]]; }
cluster_ok() { "$REDIS_CLI" -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

cmd_start() {
  local dir=$1 port
  shift
  local -a ports=("$@")
  [[ ${#ports[@]} -eq 0 ]] && ports=(7001 7002 7003)
  [[ ${#ports[@]} -eq 3 ]] || die_usage "start needs DIR and three ports (or none for 7001-7003)"
  for port in "${ports[@]}"; do
    [[ $port =~ ^[0-9]+$ ]] && ((port > 0 && port <= 55535)) || die_usage "bad port: $port (1-55535: PORT+10000 is its bus)"
  done
  command -v "$REDIS_SERVER" >/dev/null || fail "redis-server not found (apt-get install redis-server)"
  command -v "$REDIS_CLI" >/dev/null || fail "redis-cli not found (apt-get install redis-tools)"
  mkdir -p "$dir"
  local known=0
  for port in "${ports[@]}"; do [[ -s $dir/node-$port/nodes.conf ]] && known=$((known + 1)); done
  for port in "${ports[@]}"; do
    ! listening "$port" && ! listening $((port + 10000)) || fail "port $port or its bus port $((port + 10000)) is taken"
  done
  trap 'cmd_stop "$dir" >/dev/null' EXIT  # a failed start leaves no node running
  for port in "${ports[@]}"; do start_node "$dir" "$port"; done
  for port in "${ports[@]}"; do wait_for "redis-server on port $port answering PING" pong "$port"; done
  if ((known < 3)); then
    "$REDIS_CLI" --cluster create "${ports[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes \
      > "$dir/create.log" 2>&1 || { cat "$dir/create.log" >&2; fail "redis-cli --cluster create failed"; }
  fi
  for port in "${ports[@]}"; do wait_for "cluster_state:ok on port $port" cluster_ok "$port"; done
  trap - EXIT
  echo "Redis Cluster up on 127.0.0.1:${ports[0]} :${ports[1]} :${ports[2]} (folders in $dir)"
  echo "[cache.remote]"
  echo "url = \"redis://127.0.0.1:${ports[0]}\""
  echo "cluster = true"
}

stop_pid() {  # PIDFILE: stop that redis-server (only if the pid still is one)
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == redis-server* ]] || { rm -f "$1"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  local i
  for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  rm -f "$1"
}

cmd_stop() {
  local folder
  local -a folders
  mapfile -t folders < <(node_dirs "$1")
  for folder in "${folders[@]}"; do stop_pid "$folder/redis.pid"; done
  echo "stopped the nodes under $1"
}

cmd_clean() {
  cmd_stop "$1"
  local folder
  local -a folders
  mapfile -t folders < <(node_dirs "$1")
  for folder in "${folders[@]}"; do rm -rf -- "$folder"; done
  rm -f -- "$1/create.log"
  rmdir -- "$1" 2>/dev/null || true
  echo "removed the nodes' folders under $1"
}

cmd_status() {
  local folder port
  local -a folders
  mapfile -t folders < <(node_dirs "$1")
  for folder in "${folders[@]}"; do
    port=${folder##*/node-}
    echo "== 127.0.0.1:$port"
    "$REDIS_CLI" -p "$port" cluster info 2>&1 | grep -E '^cluster_(state|slots_ok|known_nodes)|Could not' || true
  done
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
case $1 in
  -h|--help) usage ;;
  start) [[ $# -ge 2 ]] || die_usage "start needs DIR"; shift; cmd_start "$@" ;;
  stop) [[ $# -eq 2 ]] || die_usage "stop needs DIR"; cmd_stop "$2" ;;
  clean) [[ $# -eq 2 ]] || die_usage "clean needs DIR"; cmd_clean "$2" ;;
  status) [[ $# -eq 2 ]] || die_usage "status needs DIR"; cmd_status "$2" ;;
  *) die_usage "unknown command: $1" ;;
esac
