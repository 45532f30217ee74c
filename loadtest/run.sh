#!/usr/bin/env bash
# One bounded load run against KVGate: start `kvgate serve`, wait for /ready, run locust headless
# on loopback, then write the CSV stats, a summary and a plot into one folder. See --help.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")

usage() {
    cat <<'EOF'
Usage: loadtest/run.sh [options] [-- extra `kvgate serve` arguments]

Starts `kvgate serve` on 127.0.0.1 (a free port), waits for /ready, sends one warm-up request,
runs the locust workloads of loadtest/locustfile.py headless for a bounded time and number of
users, then writes into the output folder: locust's CSV stats, a summary (requests/s, failures,
TTFT p50/p95 and hit rate per workload, hit rate per cache tier from /admin/metrics) and a plot.
The server is stopped on exit, also on Ctrl-C or an error.

Server:
  --config FILE        kvgate TOML config; its tenants' keys (the first of each) and its admin key
                       are used unless --keys / --admin-key say otherwise
  --model M            model: tiny, small, default, a folder or a hub id (overrides the config)
  --disk-cache P|off   disk KV tier folder, or off (default: a fresh OUT/kv, so each run starts cold)
  --host-cache-mb N    CPU-memory KV tier in MiB, 0 = off (default: the config's, else 1024)
  --remote-cache URL   Redis URL of the shared KV tier (default: the config's, else off)
  --port P             port (default: a free one)
  --url URL            load an already running server instead; the server options above are ignored
  --ready-timeout S    seconds to wait for /ready (default 900: the default model is converted
                       once on first use, which takes minutes)
  -- ARGS...           anything else for `kvgate serve`, e.g. -- --log-level warning

Load:
  --users N            concurrent locust users (default 4: one per workload)
  --spawn-rate R       users started per second (default 4)
  --run-time T         load duration, locust syntax: 30s, 2m (default 30s)
  --workloads LIST     comma-separated workloads or user classes (default all):
                       shared-system (SharedSystemPromptUser), multi-turn (MultiTurnUser),
                       document-qa (DocumentQAUser), unique (UniquePromptUser)
  --tags LIST          the same as --workloads
  --keys LIST          comma-separated tenant API keys, one per user in turn (default: $KVGATE_KEYS,
                       else from --config; none = no Authorization header)
  --admin-key KEY      key for /admin/metrics (default: $KVGATE_ADMIN_KEY, else from --config)
  --quiet              locust prints only its final tables, not every 2 s

  -h, --help           show this help and exit

Output:
  --out DIR            output folder (default ${TMPDIR:-/tmp}/kvgate-load/<date>-<time>)
  --label NAME         the run's name in the summary (default: the folder's name)

Environment: KVGATE_MODEL, KVGATE_MAX_TOKENS, KVGATE_SYSTEM_WORDS, KVGATE_DOC_WORDS, KVGATE_DOCS,
KVGATE_QUESTION_WORDS, KVGATE_TURN_WORDS, KVGATE_MAX_TURNS, KVGATE_UNIQUE_WORDS, KVGATE_SEED and
KVGATE_WAIT_S shape the workloads (loadtest/README.md); KVGATE_CACHE_DIR is the server's cache
folder (models, secret); PYTHON is the interpreter with kvgate and locust (default .venv/bin/python).

Files in the output folder:
  locust_stats.csv     one row per workload: POST (whole stream) and TTFT (first token), in ms
  locust_*.csv, locust.html, locust.log   the rest of locust's output
  workloads.json       prompt and cached tokens per workload (usage.prompt_tokens_details)
  metrics_before.json, metrics_after.json   /admin/metrics around the load
  summary.md, summary.json, summary.png     the summary and its plot
  server.log, run.json the server's log and this run's parameters

Exit status: 0 when the run had no failures, locust's status (1) when it had some, 2 for bad
options, 1 when the server did not become ready.

Example:
  loadtest/run.sh --model tiny --users 4 --run-time 30s --out /tmp/kvgate-load
EOF
}

log() { printf '[run.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 2; }

CONFIG="" MODEL="" DISK="" HOST_MB="" REMOTE="" PORT="" URL="" READY_TIMEOUT=900
USERS=4 SPAWN_RATE=4 RUN_TIME=30s WORKLOADS="" KEYS="${KVGATE_KEYS:-}" ADMIN_KEY="${KVGATE_ADMIN_KEY:-}"
KEYS_SET=${KVGATE_KEYS+1} ADMIN_SET=${KVGATE_ADMIN_KEY+1} QUIET="" OUT="" LABEL=""
SERVE_EXTRA=()

need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --config) need "$@"; CONFIG=$2; shift 2 ;;
        --model) need "$@"; MODEL=$2; shift 2 ;;
        --disk-cache) need "$@"; DISK=$2; shift 2 ;;
        --host-cache-mb) need "$@"; HOST_MB=$2; shift 2 ;;
        --remote-cache) need "$@"; REMOTE=$2; shift 2 ;;
        --port) need "$@"; PORT=$2; shift 2 ;;
        --url) need "$@"; URL=${2%/}; shift 2 ;;
        --ready-timeout) need "$@"; READY_TIMEOUT=$2; shift 2 ;;
        --users) need "$@"; USERS=$2; shift 2 ;;
        --spawn-rate) need "$@"; SPAWN_RATE=$2; shift 2 ;;
        --run-time) need "$@"; RUN_TIME=$2; shift 2 ;;
        --workloads|--tags) need "$@"; WORKLOADS=$2; shift 2 ;;
        --keys) need "$@"; KEYS=$2; KEYS_SET=1; shift 2 ;;
        --admin-key) need "$@"; ADMIN_KEY=$2; ADMIN_SET=1; shift 2 ;;
        --quiet) QUIET=1; shift ;;
        --out) need "$@"; OUT=$2; shift 2 ;;
        --label) need "$@"; LABEL=$2; shift 2 ;;
        --) shift; SERVE_EXTRA=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

[[ $USERS =~ ^[1-9][0-9]*$ ]] || die "--users must be a positive whole number, not '$USERS'"
[[ $READY_TIMEOUT =~ ^[0-9]+$ ]] || die "--ready-timeout must be whole seconds, not '$READY_TIMEOUT'"
[[ -z $CONFIG || -f $CONFIG ]] || die "--config $CONFIG: no such file"

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=$(command -v python3) || die "no python: set PYTHON"
KVGATE=$(dirname "$PYTHON")/kvgate
[[ -x $KVGATE ]] || KVGATE=$(command -v kvgate) || die "kvgate is not installed next to $PYTHON nor on PATH"
"$PYTHON" -c 'import locust' 2>/dev/null || die "locust is missing: $PYTHON -m pip install -e '.[dev]'"
command -v curl >/dev/null || die "curl is needed to poll /ready"

# User classes from workload names.
declare -A CLASS_OF=([shared-system]=SharedSystemPromptUser [multi-turn]=MultiTurnUser
                     [document-qa]=DocumentQAUser [unique]=UniquePromptUser)
CLASSES=()
if [[ -n $WORKLOADS ]]; then
    IFS=, read -r -a names <<<"$WORKLOADS"
    for name in "${names[@]}"; do
        if [[ -n ${CLASS_OF[$name]:-} ]]; then CLASSES+=("${CLASS_OF[$name]}")
        elif [[ " ${CLASS_OF[*]} " == *" $name "* ]]; then CLASSES+=("$name")
        else die "unknown workload '$name' (shared-system, multi-turn, document-qa, unique)"
        fi
    done
fi

# Keys from the config unless given.
if [[ -n $CONFIG ]]; then
    [[ -n $KEYS_SET ]] || KEYS=$("$PYTHON" "$HERE/summary.py" keys "$CONFIG" tenants)
    [[ -n $ADMIN_SET ]] || ADMIN_KEY=$("$PYTHON" "$HERE/summary.py" keys "$CONFIG" admin)
fi

OUT=${OUT:-${TMPDIR:-/tmp}/kvgate-load/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LABEL=${LABEL:-$(basename "$OUT")}
DISK=${DISK:-$OUT/kv}

SERVER_PID=""
stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        log "stopping the server (pid $SERVER_PID; it drains and writes its KV blocks to disk)"
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 300); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "the server did not stop in 30 s: killing it"
            kill -KILL "$SERVER_PID" 2>/dev/null || true
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_server() {
    PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    URL=http://127.0.0.1:$PORT
    local args=(serve --host 127.0.0.1 --port "$PORT" --disk-cache "$DISK")
    [[ -z $CONFIG ]] || args+=(--config "$CONFIG")
    [[ -z $MODEL ]] || args+=(--model "$MODEL")
    [[ -z $HOST_MB ]] || args+=(--host-cache-mb "$HOST_MB")
    [[ -z $REMOTE ]] || args+=(--remote-cache "$REMOTE")
    args+=("${SERVE_EXTRA[@]}")
    log "starting: kvgate ${args[*]} (log: $OUT/server.log)"
    "$KVGATE" "${args[@]}" >"$OUT/server.log" 2>&1 &
    SERVER_PID=$!
}

wait_ready() {
    log "waiting for $URL/ready (loading the model; up to ${READY_TIMEOUT}s)"
    local start=$SECONDS next=10 rc
    until curl -sf -o /dev/null --max-time 5 "$URL/ready"; do
        if [[ -n $SERVER_PID ]] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
            wait "$SERVER_PID" && rc=0 || rc=$?
            SERVER_PID=""
            log "the server exited with status $rc; the end of its log:"
            tail -n 20 "$OUT/server.log" >&2
            exit 1
        fi
        if (( SECONDS - start >= READY_TIMEOUT )); then
            log "not ready after ${READY_TIMEOUT}s; the end of the server's log:"
            tail -n 20 "$OUT/server.log" >&2 || true
            exit 1
        fi
        if (( SECONDS - start >= next )); then
            log "still loading after $(( SECONDS - start ))s"
            next=$(( next + 10 ))
        fi
        sleep 0.5
    done
    log "ready after $(( SECONDS - start ))s"
}

write_run_json() {
    "$PYTHON" -c 'import json, sys; a = sys.argv[1:]; print(json.dumps(dict(zip(a[::2], a[1::2])), indent=1))' \
        label "$LABEL" users "$USERS" spawn_rate "$SPAWN_RATE" run_time "$RUN_TIME" model "$MODEL" \
        config "$CONFIG" workloads "$WORKLOADS" disk_cache "$DISK" host_cache_mb "$HOST_MB" \
        remote_cache "$REMOTE" url "$URL" tenant_keys "$NKEYS" started "$(date -Iseconds)" >"$OUT/run.json"
}

NKEYS=$(awk -F, '{print NF}' <<<"$KEYS")
if [[ -z $URL ]]; then
    start_server
else
    log "using the running server at $URL"
fi
write_run_json
wait_ready

log "warm-up: one short request (first-request costs stay out of the figures)"
"$PYTHON" "$HERE/summary.py" warmup "$URL" --key "${KEYS%%,*}"

log "metrics before the load: $OUT/metrics_before.json"
"$PYTHON" "$HERE/summary.py" snapshot "$URL" "$OUT/metrics_before.json" --admin-key "$ADMIN_KEY"

log "load: $USERS users (spawn rate $SPAWN_RATE/s) for $RUN_TIME, workloads ${WORKLOADS:-all}, $NKEYS tenant key(s)"
locust_args=(-m locust -f "$HERE/locustfile.py" --headless --host "$URL" --users "$USERS"
             --spawn-rate "$SPAWN_RATE" --run-time "$RUN_TIME" --stop-timeout 10
             --csv "$OUT/locust" --html "$OUT/locust.html" --kv-report "$OUT/workloads.json")
[[ -z $QUIET ]] || locust_args+=(--only-summary)
set +e
KVGATE_KEYS=$KEYS "$PYTHON" "${locust_args[@]}" "${CLASSES[@]}" 2>&1 | tee "$OUT/locust.log"
locust_rc=${PIPESTATUS[0]}
set -e
log "locust finished with status $locust_rc"

log "metrics after the load: $OUT/metrics_after.json"
"$PYTHON" "$HERE/summary.py" snapshot "$URL" "$OUT/metrics_after.json" --admin-key "$ADMIN_KEY"
stop_server

log "summary: $OUT/summary.md, plot: $OUT/summary.png"
"$PYTHON" "$HERE/summary.py" report "$OUT" --label "$LABEL"
exit "$locust_rc"
