#!/usr/bin/env bash
# arborlm itself (from this checkout's venv); extra arguments go to `arborlm serve`,
# e.g. `start 30000 --disable-radix-cache`.
PEER=arborlm
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "${1:-}" in
  install) "$ARBORLM_PY" -c 'import arborlm' || skip "arborlm is not installed in $ARBORLM_PY" ;;
  start)
    port="${2:?port}"; shift 2
    exec "$ARBORLM_PY" -m arborlm serve --host 127.0.0.1 --port "$port" --dtype "$PEER_DTYPE" --log-level warning "$@" ;;
  *) echo "usage: $0 install | start PORT [arborlm serve args]" >&2; exit 2 ;;
esac
