#!/usr/bin/env bash
# Starts P processes of one gyrejax job on this machine, on loopback (tests, experiments).
#
#   launch/local.sh P [--port PORT] [--pin] -- python -m gyrejax.launch --config ... --workdir ...
#
# Each process gets --coordinator 127.0.0.1:PORT --num_processes P --process_id I appended
# to the command, and its output goes to ${LOG_DIR:-/tmp}/gyrejax_process_I.log (process 0
# is also echoed). With CPU-emulated devices (config.cells.num_cpu_devices, per process)
# the processes talk through gloo collectives. --pin runs process I on core I mod (cores)
# only (taskset), as if each were a host of its own: a cell that process frees adds its
# core's compute, which emulated devices sharing every core cannot show. Exits with the
# first non-zero status.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,12p' "$0"; exit 2
fi
num_processes=$1; shift
port=""
if [[ $1 == --port ]]; then port=$2; shift 2; fi
pin=""
if [[ $1 == --pin ]]; then pin=1; shift; fi
[[ $1 == -- ]] && shift
if [[ -z $port ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
log_dir=${LOG_DIR:-/tmp}
mkdir -p "$log_dir"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for ((i = num_processes - 1; i >= 0; i--)); do
  args=("$@" --coordinator "127.0.0.1:$port" --num_processes "$num_processes" --process_id "$i")
  if [[ -n $pin ]]; then args=(taskset -c $((i % $(nproc))) "${args[@]}"); fi
  if ((i == 0)); then
    "${args[@]}" 2>&1 | tee "$log_dir/gyrejax_process_0.log" &
  else
    "${args[@]}" >"$log_dir/gyrejax_process_$i.log" 2>&1 &
  fi
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
trap - EXIT
exit "$status"
