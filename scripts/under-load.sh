#!/usr/bin/env bash
# The README's test command with CPU burners beside it (issue 52: the suite holds on a busy machine).
#
#   scripts/under-load.sh [RUNS] [BURNERS]      (defaults: 1 run, 2 burners)
#
# Each run is `make test` from this checkout, its output in .under-load/run-N.log; one line a run says
# its end, its exit status, its wall time and the load average. Burners are `python3 -c "while 1: pass"`,
# started before a run and killed after it, with everything the run started (its own process group), also
# when this script is interrupted. Runs stop at the first failure. Exit status: the last run's.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
burners=${2:-2}
mkdir -p .under-load
pids=()
stop() {
  for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null; done
  pids=()
}
trap 'stop; exit 130' INT TERM
rc=0
for run in $(seq "$runs"); do
  for _ in $(seq "$burners"); do
    setsid python3 -c "while 1: pass" & pids+=($!)
  done
  start=$(date +%s)
  echo "run $run: $(date +%T), commit $(git rev-parse --short HEAD), $burners burners, load $(cut -d' ' -f1-3 /proc/loadavg)"
  setsid make test > ".under-load/run-$run.log" 2>&1 & make_pid=$!
  pids+=("$make_pid")
  wait "$make_pid"; rc=$?
  stop
  echo "run $run: exit $rc in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(grep -E '(passed|failed).* in ' ".under-load/run-$run.log" | tail -1)"
  [ "$rc" -eq 0 ] || break
done
exit "$rc"
