#!/usr/bin/env bash
# `transformers serve --continuous-batching` (the transformers version of arborlm's venv, with its
# serving extras) in its own venv under $PEERS_CACHE/transformers-serve, reusing the local torch
# CPU build. 256 blocks of 32 tokens: without a block count it takes 11 GB.
# It refuses unknown request fields (send no ignore_eos) and ignores response_format.
PEER=transformers-serve
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
VENV="$PEERS_CACHE/transformers-serve"

install() {
  if [[ -x "$VENV/bin/transformers" ]] && "$VENV/bin/python" -c 'import fastapi, uvicorn, transformers' 2>/dev/null; then
    return
  fi
  local version
  version="$("$ARBORLM_PY" -c 'import transformers; print(transformers.__version__)')"
  log "installing transformers[serving]==$version into $VENV"
  make_venv_with_local_torch "$VENV" || skip "could not create $VENV"
  "$VENV/bin/python" -m pip install "transformers[serving]==$version" \
    || "$VENV/bin/python" -m pip install "transformers[serving]" \
    || skip "pip install transformers[serving] failed"
  "$VENV/bin/transformers" serve --help >/dev/null || skip "transformers serve does not start"
}

case "${1:-}" in
  install) install ;;
  start)
    port="${2:?port}"
    exec "$VENV/bin/transformers" serve "$(model_dir)" --continuous-batching --cb-num-blocks 256 --cb-block-size 32 \
      --device cpu --dtype "$PEER_DTYPE" --host 127.0.0.1 --port "$port" ;;
  *) echo "usage: $0 install | start PORT" >&2; exit 2 ;;
esac
