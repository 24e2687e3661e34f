#!/usr/bin/env bash
# A two-level "cluster" on one machine: 2 network namespaces ("nodes") x 2 ranks each, joined
# by a veth pair whose two ends are rate-limited with tc tbf (the inter-node link); ranks of
# one node talk through their namespace's own address. Needs root and iproute2.
#   bash benchmarks/bench_topology.sh [RATE ...]     e.g. 1gbit 100mbit (default: unlimited 1gbit 100mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RATES=("${@:-unlimited 1gbit 100mbit}")
[ $# -eq 0 ] && RATES=(unlimited 1gbit 100mbit)
cleanup() { ip netns del ta-n0 2>/dev/null || true; ip netns del ta-n1 2>/dev/null || true; rm -rf "$TMP"; }
TMP=$(mktemp -d); trap cleanup EXIT
cleanup; TMP=$(mktemp -d)
ip netns add ta-n0; ip netns add ta-n1
ip link add ta-v0 type veth peer name ta-v1
ip link set ta-v0 netns ta-n0; ip link set ta-v1 netns ta-n1
ip -n ta-n0 addr add 10.77.0.1/24 dev ta-v0; ip -n ta-n1 addr add 10.77.0.2/24 dev ta-v1
for n in 0 1; do ip -n ta-n$n link set lo up; ip -n ta-n$n link set ta-v$n up; done
for rate in "${RATES[@]}"; do
  for n in 0 1; do
    ip netns exec ta-n$n tc qdisc del dev ta-v$n root 2>/dev/null || true
    if [ "$rate" != unlimited ]; then
      ip netns exec ta-n$n tc qdisc add dev ta-v$n root tbf rate "$rate" burst 256kb latency 400ms
    fi
  done
  store="$TMP/store-$rate"; pids=()
  for r in 0 1 2 3; do
    n=$((r / 2))
    ip netns exec ta-n$n env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
      GLOO_SOCKET_IFNAME=ta-v$n OMP_NUM_THREADS=1 "$PY" benchmarks/topology_worker.py --store "$store" --label "$rate" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
done
