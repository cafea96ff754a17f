#!/usr/bin/env bash
# Install the peer servers the benchmark compares tessera with, each in a venv
# of its own under ${TESSERA_PEERS_DIR:-$HOME/.cache/tessera/peers}/NAME:
#   pytriton  torchserve  infinity  litserve  rayserve
# Idempotent: a venv whose stamp file matches this script's pins is skipped.
# One peer failing does not stop the others; a summary is printed at the end,
# and the exit status is non-zero when any peer failed.
#
#   bash scripts/bench-peers.sh [NAME ...]      (or: make bench-peers)
#
# torch is the CPU build that this machine serves from local disk; it goes in
# first and stays pinned through a constraints file, since a bare `torch`
# requirement would pull a multi-GB CUDA build from the index.
set -u

cd "$(dirname "$0")/.."
PEERS_DIR="${TESSERA_PEERS_DIR:-$HOME/.cache/tessera/peers}"
TORCH="torch==2.13.0"
TRANSFORMERS="transformers==5.24.0"

# The same interpreter as the main venv, where there is one.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then
        PYTHON="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
    else
        PYTHON=python3
    fi
fi

packages() {
    case "$1" in
    pytriton) echo "nvidia-pytriton==0.7.0 $TRANSFORMERS" ;;
    torchserve) echo "torchserve==0.12.0 torch-model-archiver==0.12.0 $TRANSFORMERS" ;;
    # Infinity needs sentence-transformers 3, hence transformers 4.
    infinity) echo "infinity-emb[server,torch]==0.0.78 sentence-transformers==3.4.1 transformers==4.57.6" ;;
    litserve) echo "litserve==0.2.19 $TRANSFORMERS" ;;
    # Ray Serve's model multiplexing (benchmarks/peers/rayserve_server.py).
    rayserve) echo "ray[serve]==2.60.* $TRANSFORMERS" ;;
    *) return 1 ;;
    esac
}

# pip, without its notes about this machine's local index folders lacking a package.
pip_in() {
    local venv="$1"
    shift
    "$venv/bin/python" -m pip "$@" 2>&1 | grep -v 'is ignored: it is neither a file nor a directory'
    return "${PIPESTATUS[0]}"
}

install_peer() {
    local name="$1" venv="$PEERS_DIR/$1" pkgs stamp_text
    pkgs="$(packages "$name")" || { echo "unknown peer: $name" >&2; return 2; }
    stamp_text="$TORCH $pkgs"
    if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.tessera-peer" 2>/dev/null)" = "$stamp_text" ]; then
        echo "[$name] up to date ($venv)"
        return 0
    fi
    echo "[$name] installing into $venv: $stamp_text"
    rm -f "$venv/.tessera-peer"
    "$PYTHON" -m venv "$venv" || return 1
    printf '%s\n' "$TORCH" >"$venv/constraints.txt"
    pip_in "$venv" install --quiet --upgrade pip || return 1
    pip_in "$venv" install --quiet "$TORCH" || return 1
    # shellcheck disable=SC2086  # $pkgs is a list of requirements
    pip_in "$venv" install --quiet -c "$venv/constraints.txt" $pkgs || return 1
    "$venv/bin/python" -c 'import torch, sys; v = torch.__version__; sys.exit(v != "2.13.0+cpu" and f"torch is {v}")' || return 1
    printf '%s' "$stamp_text" >"$venv/.tessera-peer"
}

main() {
    local names=("$@") name start status=0 summary=()
    [ ${#names[@]} -gt 0 ] || names=(pytriton torchserve infinity litserve rayserve)
    mkdir -p "$PEERS_DIR"
    echo "peers in $PEERS_DIR, python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
    for name in "${names[@]}"; do
        start=$SECONDS
        if install_peer "$name"; then
            summary+=("$(printf '  %-11s ok      %4d s' "$name" $((SECONDS - start)))")
        else
            summary+=("$(printf '  %-11s FAILED  %4d s' "$name" $((SECONDS - start)))")
            status=1
        fi
    done
    echo "bench-peers summary:"
    printf '%s\n' "${summary[@]}"
    return $status
}

main "$@"
