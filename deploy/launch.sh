#!/usr/bin/env bash
# Bring up a pdserve cluster on this host from the shell: one router and N prefill + M decode
# workers (or K mono workers), each a separate process started exactly as you would start it on
# its own host in a multi-host deployment. Logs go to one file per process; a worker that crashes
# is restarted with backoff; Ctrl-C or SIGTERM stops every process started here, and so does
# killing this script outright. Workers that share a GPU split it as `pdserve launch` does
# (decode workers get the larger shares) unless WORKER_ARGS size the pool (--gpu-memory-utilization,
# --kv-cache-gb, --num-blocks).
#
#   deploy/launch.sh [--prefill N] [--decode M] [--mono K] [--model SPEC] [--devices cpu,cuda:0,...]
#                    [--host ADDR] [--port P] [--worker-port P] [--http-port P] [--api-server-count N]
#                    [--api-key K] [--allowed-origins O,O] [--served-model-name NAME]... [--threads N]
#                    [--tool-call-parser hermes|llama3_json] [--enable-auto-tool-choice]
#                    [--reasoning-parser qwen3|deepseek_r1] [--generation-config auto|vllm|DIR]
#                    [--override-generation-config JSON] [--metrics-prefix pdserve|vllm]
#                    [--policy least_loaded|round_robin|prefix_affine] [--no-kv-events]
#                    [--max-queue N] [--heartbeat-timeout S] [--max-attempts N] [--prefill-timeout S]
#                    [--decode-stall-timeout S] [--queue-timeout S] [--max-message-bytes N]
#                    [--max-local-prefill-length N] [--max-prefill-queue N] [--enforce-disagg] [--log-requests]
#                    [--drain-timeout S]
#                    [--log-dir DIR] [--no-restart] [--dry-run] [-- WORKER_ARGS...]
#
# The flags are `pdserve launch`'s (--drain-timeout goes to the router and to every worker); engine
# flags (--kv-transport, --max-num-seqs, ...) go to the workers after `--`. Prints "ready: router at
# tcp://HOST:PORT" once every worker has registered, after "workers join at tcp://HOST:WORKER_PORT"
# and, with --http-port, "HTTP API at http://HOST:P" (--api-key K, or PDSERVE_API_KEY in the
# environment, sets its key, and --api-server-count N serves it from N processes beside the
# router); --dry-run prints each process's command line instead and exits.
set -uo pipefail

PREFILL="" DECODE="" MONO=0 MODEL=dummy:nanogpt DEVICES=cpu HOST=127.0.0.1 PORT=7100 WORKER_PORT="" HTTP_PORT=""
API_SERVERS=1 POLICY=least_loaded
LOG_DIR=pdserve-logs DRY_RUN=0 THREADS="" RESTART=1 API_KEY=${PDSERVE_API_KEY:-}
WORKER_ARGS=() ROUTER_LIMITS=() DRAIN=()

# A flag's value, checked as `pdserve launch` checks it; a bad or missing one is a usage error
# (exit 2) that names the flag, the value and what is allowed. Each takes the loop's "$@". An
# integer is then read in base 10 (bash would take 010 for octal).
refuse() { echo "launch.sh: $1 ${2:-''}: allowed: $3" >&2; exit 2; }
has_value() { (($# >= 2)) || { echo "launch.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
is_int() { [[ $1 =~ ^[0-9]{1,18}$ ]] && ((10#$1 >= $2 && (${3:-0} == 0 || 10#$1 <= ${3:-0}))); }  # N MIN [MAX]
int_value() { local min=$1; shift; has_value "$@"; is_int "$2" "$min" || refuse "$1" "$2" "an integer >= $min"; }
port_value() {
  has_value "$@"
  is_int "$2" 1 65535 || refuse "$1" "$2" "a port number 1..65535 (pdserve launch picks free ports for 0)"
}
number_value() {  # OP BOUND FLAG VALUE: a number OP (> or >=) BOUND
  local op=$1 bound=$2; shift 2
  has_value "$@"
  [[ $2 =~ ^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$ ]] &&
    awk -v x="$2" -v b="$bound" -v op="$op" 'BEGIN { exit !(op == ">" ? x + 0 > b + 0 : x + 0 >= b + 0) }' ||
    refuse "$1" "$2" "a number $op $bound"
}

while (($#)); do
  case "$1" in
    --prefill) int_value 0 "$@"; PREFILL=$((10#$2)); shift 2 ;;
    --decode) int_value 0 "$@"; DECODE=$((10#$2)); shift 2 ;;
    --mono) int_value 0 "$@"; MONO=$((10#$2)); shift 2 ;;
    --model) has_value "$@"; MODEL=$2; shift 2 ;;
    --devices) has_value "$@"; DEVICES=$2; shift 2 ;;
    --host) has_value "$@"; HOST=$2; shift 2 ;;
    --port) port_value "$@"; PORT=$((10#$2)); shift 2 ;;
    --worker-port) port_value "$@"; WORKER_PORT=$((10#$2)); shift 2 ;;
    --http-port) port_value "$@"; HTTP_PORT=$((10#$2)); shift 2 ;;
    --api-server-count) int_value 1 "$@"; API_SERVERS=$((10#$2)); shift 2 ;;
    --policy) has_value "$@"; POLICY=$2; shift 2 ;;
    --log-dir) has_value "$@"; LOG_DIR=$2; shift 2 ;;
    --threads) int_value 1 "$@"; THREADS=$((10#$2)); shift 2 ;;
    --api-key) has_value "$@"; API_KEY=$2; shift 2 ;;
    --allowed-origins|--served-model-name|--tool-call-parser|--reasoning-parser|--generation-config|\
    --override-generation-config) has_value "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --metrics-prefix) has_value "$@"; [[ $2 == pdserve || $2 == vllm ]] || refuse "$1" "$2" "pdserve or vllm"
      ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --enable-auto-tool-choice|--enforce-disagg|--no-kv-events|--log-requests) ROUTER_LIMITS+=("$1"); shift ;;
    # the router's limits, as ROUTER_OPTIONS in common/cli_options.py bounds them
    --max-queue|--max-attempts) int_value 1 "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --max-message-bytes) int_value 4096 "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --max-local-prefill-length|--max-prefill-queue) int_value 0 "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --heartbeat-timeout) number_value ">=" 0.5 "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --prefill-timeout|--decode-stall-timeout|--queue-timeout)
      number_value ">" 0 "$@"; ROUTER_LIMITS+=("$1" "$2"); shift 2 ;;
    --drain-timeout) number_value ">=" 0 "$@"; ROUTER_LIMITS+=("$1" "$2"); DRAIN=("$1" "$2"); shift 2 ;;
    --no-restart) RESTART=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; WORKER_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "launch.sh: unknown option $1; a worker's or engine's flag goes after --, to every worker" \
         "(launch.sh --prefill 1 -- $1 ...; see --help)" >&2; exit 2 ;;
  esac
done
PREFILL=${PREFILL:-$((MONO > 0 ? 0 : 1))} DECODE=${DECODE:-$((MONO > 0 ? 0 : 1))}  # --mono alone: only mono workers
if ((PREFILL > 0 && DECODE == 0)); then
  echo "launch.sh: --prefill $PREFILL --decode 0: prefill workers need a decode worker to hand KV to;" \
    "allowed: --decode >= 1, or --prefill 0 with --mono (mono workers prefill for themselves)" >&2
  exit 2
fi
if ((PREFILL == 0 && DECODE > 0)) && [[ " ${ROUTER_LIMITS[*]} " == *" --enforce-disagg "* ]]; then
  echo "launch.sh: --prefill 0 --decode $DECODE with --enforce-disagg: no worker may prefill; allowed: --prefill >= 1, or decode workers alone without --enforce-disagg (they prefill)" >&2
  exit 2
fi
WORKER_PORT=${WORKER_PORT:-$((PORT + 1))}
# Whether something accepts connections at HOST PORT (one that hangs, to a host that drops it, does not).
listening() { timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; }
# Another router on these ports would answer the readiness check below, and take our workers.
declare -A PORT_FLAG=()
for flag_port in "--port $PORT" "--worker-port $WORKER_PORT" ${HTTP_PORT:+"--http-port $HTTP_PORT"}; do
  read -r flag port <<<"$flag_port"
  port_value "$flag" "$port"  # the worker port --port 65535 implies, too
  [[ -z ${PORT_FLAG[$port]:-} ]] || refuse "$flag" "$port" \
    "a port of its own, not ${PORT_FLAG[$port]}'s (--worker-port defaults to --port + 1)"
  PORT_FLAG[$port]=$flag
  # (a port that does not answer counts as free: the router's bind then decides)
  ((DRY_RUN)) || ! listening "$HOST" "$port" ||
    { echo "launch.sh: port $port on $HOST is in use (another pdserve router?); allowed: a free port for $flag" >&2; exit 2; }
done
PDSERVE=${PDSERVE:-pdserve}
command -v "$PDSERVE" >/dev/null || PDSERVE="python3 -m common.cli"
IFS=, read -ra DEVICE_LIST <<<"$DEVICES"
WORKERS=$((PREFILL + DECODE + MONO))
# torch threads per worker: one core left to the router and the system (as pdserve launch does)
if [[ -z $THREADS ]]; then
  THREADS=$(( ($(nproc) - 1) / (WORKERS > 0 ? WORKERS : 1) )); ((THREADS < 1)) && THREADS=1
fi
# Each worker's share of its GPU, in launch order ("-" off a GPU, or when the worker args size the
# pool), as pdserve launch splits them.
# It refuses, by name, what no launch may start (more than 64 workers on one host, a --model or
# --policy it lacks, worker flags a worker would refuse).
refused=$(mktemp)
shares=$($PDSERVE gpu-shares --prefill "$PREFILL" --decode "$DECODE" --mono "$MONO" --model "$MODEL" \
  --devices "$DEVICES" --policy "$POLICY" -- "${WORKER_ARGS[@]}" 2>"$refused") ||
  { echo "launch.sh: $(grep -v '^Usage: \|^Try \|^$' "$refused" | sed 's/^error \[[A-Z_]*\]: //; s/^Error: //')" >&2
    rm -f "$refused"; exit 2; }
rm -f "$refused"
mapfile -t SHARES <<<"$shares"
((${#SHARES[@]} == WORKERS)) || { echo "launch.sh: could not split the devices ($PDSERVE gpu-shares)" >&2; exit 1; }

ROUTER_ARGS=(--policy "$POLICY" "${ROUTER_LIMITS[@]}")
[[ -n $HTTP_PORT ]] && ROUTER_ARGS+=(--http-port "$HTTP_PORT" --api-server-count "$API_SERVERS")
for ((i = 0; i < ${#WORKER_ARGS[@]}; i++)); do  # the router admits the context the workers serve
  case ${WORKER_ARGS[i]} in
    --max-model-len) ROUTER_ARGS+=(--max-model-len "${WORKER_ARGS[i + 1]}") ;;
    --max-model-len=*) ROUTER_ARGS+=("${WORKER_ARGS[i]}") ;;
  esac
done
if ((DRY_RUN)); then
  echo "router: $PDSERVE router --model $MODEL --host $HOST --port $PORT --worker-port $WORKER_PORT ${ROUTER_ARGS[*]}"
else
  mkdir -p "$LOG_DIR"
fi

# Run "$@" as process NAME, restarting it with exponential backoff (0.5 s doubling to 8 s, reset
# after 30 s of health) until this supervisor is told to stop; but not after a usage error (exit 2:
# a bad flag or model, which would fail alike again).
say() { echo "$(date '+%F %T') [launch.sh] $1"; }  # stamped as the processes' own lines are
ended() {  # how a child ended, in words, as pdserve launch says it: "exited with 1", "was killed by SIGKILL"
  if (($1 > 128)) && kill -l $(($1 - 128)) >/dev/null 2>&1; then echo "was killed by SIG$(kill -l $(($1 - 128)))"
  else echo "exited with $1"; fi
}
supervise() {
  local name=$1; shift
  local child="" delay=0.5 started
  stop_child() {  # a second TERM (a process group's, then stop()'s) cuts a wait short: wait until it is gone
    [[ -n $child ]] && kill -TERM "$child" 2>/dev/null
    while kill -0 "$child" 2>/dev/null; do wait "$child"; done 2>/dev/null
    exit 0
  }
  trap stop_child TERM
  trap '' INT  # a terminal's Ctrl-C is this script's, which stops each process once (common/signals.py)
  while true; do
    local offset  # where this run's lines begin in the log, which keeps earlier runs'
    offset=$(stat -c %s "$LOG_DIR/$name.log" 2>/dev/null || echo 0)
    # shellcheck disable=SC2086
    $PDSERVE "$@" >>"$LOG_DIR/$name.log" 2>&1 &
    child=$!
    started=$SECONDS
    wait "$child" 2>/dev/null  # (bash's own "Killed" line: the one below says it)
    local rc=$?
    echo "$name $rc $offset" >>"$EXITS"  # the readiness check below fails the start on any
    ((RESTART)) || { say "$name $(ended "$rc"); not restarted (--no-restart)" | tee -a "$LOG_DIR/$name.log" >&2; return; }
    if ((rc == 2)); then  # (a usage error comes at start, which the readiness check below reports)
      say "$name exited with 2, a usage error; not restarted" >>"$LOG_DIR/$name.log"
      return
    fi
    ((SECONDS - started > 30 || rc == 0)) && delay=0.5  # healthy, or left as told (a rolling restart)
    say "$name $(ended "$rc"); restarting in ${delay}s" | tee -a "$LOG_DIR/$name.log" >&2
    sleep "$delay" & wait $!
    delay=$(awk -v d="$delay" 'BEGIN { d *= 2; print (d > 8 ? 8 : d) }')
  done
}

PIDS=()
EXITS=$(mktemp)  # "NAME RC OFFSET" of each process that exited, as supervise saw it
stop() {  # every process at once, each draining: the router carries the tokens of what the workers finish
  trap - INT TERM EXIT
  ((${#PIDS[@]})) && kill -TERM "${PIDS[@]}" 2>/dev/null
  wait
  rm -f "$EXITS"
  echo "stopped"
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

# The API key reaches the router alone, by its environment (argv would show it in ps).
[[ -n $API_KEY ]] && export PDSERVE_API_KEY=$API_KEY
((DRY_RUN)) || { supervise router router --model "$MODEL" --host "$HOST" --port "$PORT" --worker-port "$WORKER_PORT" \
                   "${ROUTER_ARGS[@]}" &
                 PIDS+=($!); }
unset PDSERVE_API_KEY
i=0
for role in prefill decode mono; do
  count_var=${role^^}
  for ((n = 0; n < ${!count_var}; n++)); do
    device=${DEVICE_LIST[$((i % ${#DEVICE_LIST[@]}))]}
    memory=()
    [[ ${SHARES[i]:--} != - ]] && memory=(--gpu-memory-utilization "${SHARES[i]}")
    args=("$role" --router "tcp://$HOST:$WORKER_PORT" --worker-id "$role-$n" --model "$MODEL" --device "$device"
          --host "$HOST" --threads "$THREADS" "${memory[@]}" "${DRAIN[@]}" "${WORKER_ARGS[@]}")
    if ((DRY_RUN)); then
      echo "$role-$n: $PDSERVE ${args[*]}"
    else
      supervise "$role-$n" "${args[@]}" &
      PIDS+=($!)
    fi
    i=$((i + 1))
  done
done
((DRY_RUN)) && { trap - EXIT; exit 0; }

# A SIGKILL of this script runs no trap: a watcher stops the cluster once the script is gone
# (its parent is no longer this script; a killed script not yet reaped is still "alive" to kill -0).
# Builtins and /proc only, no ps: where /proc cannot be read it watches nothing.
watch_launcher() {
  trap - TERM EXIT
  trap '' INT
  local stat ppid
  while read -r stat <"/proc/$BASHPID/stat"; do
    read -r _ ppid _ <<<"${stat##*) }"  # after "PID (NAME) ": STATE PPID ...
    [[ $ppid == "$$" ]] || { kill -TERM "${PIDS[@]}" 2>/dev/null; return; }
    sleep 1
  done 2>/dev/null
}
watch_launcher &
PIDS+=($!)

# Ready once the router reports every worker alive, within READY_TIMEOUT_S; a process that exits
# while starting (a bad flag, a model that does not load) fails the start at once, with its log's end.
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
alive=0
while ((SECONDS < READY_TIMEOUT_S)); do
  if read -r name rc offset <"$EXITS"; then
    echo "launch.sh: $name exited with $rc during start-up; see $LOG_DIR/$name.log:" >&2
    tail -c +$((offset + 1)) "$LOG_DIR/$name.log" | grep -v '^\[launch.sh\]' | uniq | tail -n 15 >&2
    exit 1
  fi
  # asked only once the router listens: a status call to no router waits seconds, while a process that
  # exited would go unseen
  listening "$HOST" "$PORT" &&
    alive=$(timeout 5 $PDSERVE status --router "tcp://$HOST:$PORT" --json 2>/dev/null |
            python3 -c 'import json,sys; print(sum(w["alive"] for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)
  if [[ "${alive:-0}" -ge "$WORKERS" ]]; then
    [[ -n $HTTP_PORT ]] && echo "HTTP API at http://$HOST:$HTTP_PORT"
    echo "workers join at tcp://$HOST:$WORKER_PORT"  # (pdserve prefill --router)
    echo "ready: router at tcp://$HOST:$PORT"
    break
  fi
  sleep 0.5
done
[[ "${alive:-0}" -ge "$WORKERS" ]] || { echo "launch.sh: cluster not ready within ${READY_TIMEOUT_S}s; logs in $LOG_DIR" >&2; exit 1; }
while true; do wait; done
