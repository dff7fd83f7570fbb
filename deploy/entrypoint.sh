#!/bin/sh
# Entrypoint of the ddiloco image: runs `ddiloco "$@"` (default: node --config /etc/ddiloco/node.toml).
#
# For `node`, two optional steps before that, driven by the environment (see docker-compose.yml):
#   DDILOCO_PUBLISH_PEER_ID=FILE  create the node's identity if missing and write its peer id to FILE
#                                 (the bootstrap does this, into a volume the other nodes mount read-only)
#   DDILOCO_BOOTSTRAP=MADDR       a bootstrap address without /p2p/, e.g. /dns4/bootstrap/tcp/31337: wait
#                                 for DDILOCO_BOOTSTRAP_PEER_FILE (default /peer/bootstrap.peer, at most
#                                 DDILOCO_WAIT_S seconds, default 300) and append
#                                 --initial-peers MADDR/p2p/<peer id in that file>
# DDILOCO_PEER_ID_SCRIPT overrides where deploy/peer_id.py is installed. Other commands (keygen, status,
# ...) run unchanged.
set -eu

if [ "${1:-}" = node ]; then
  if [ -n "${DDILOCO_PUBLISH_PEER_ID:-}" ]; then
    out=$DDILOCO_PUBLISH_PEER_ID
    id=$(python "${DDILOCO_PEER_ID_SCRIPT:-/usr/local/lib/ddiloco/peer_id.py}" "$@")
    mkdir -p "$(dirname "$out")"
    printf '%s\n' "$id" >"$out.tmp"
    mv -f "$out.tmp" "$out"
    echo "entrypoint: peer id $id written to $out" >&2
  fi
  if [ -n "${DDILOCO_BOOTSTRAP:-}" ]; then
    file=${DDILOCO_BOOTSTRAP_PEER_FILE:-/peer/bootstrap.peer}
    wait_s=${DDILOCO_WAIT_S:-300}
    waited=0
    while [ ! -s "$file" ]; do
      if [ "$waited" -ge "$wait_s" ]; then
        echo "entrypoint: no bootstrap peer id in $file after ${wait_s}s; is the bootstrap node running?" >&2
        exit 1
      fi
      sleep 1
      waited=$((waited + 1))
    done
    boot=$(head -n 1 "$file")
    echo "entrypoint: bootstrapping from $DDILOCO_BOOTSTRAP/p2p/$boot" >&2
    set -- "$@" --initial-peers "$DDILOCO_BOOTSTRAP/p2p/$boot"
  fi
fi

exec ddiloco "$@"
