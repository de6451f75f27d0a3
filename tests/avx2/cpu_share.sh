#!/usr/bin/env bash
# cpu_share.sh SHARE COMMAND...: run COMMAND with each core left SHARE of its time, as on slower cores (an engine run
# took 2.7x as long at 0.55 and 3.7x at 0.4 with AVX2 code, more than 1/SHARE: benchmarks/emulated_cpu.py).
#
# Beside it, one busy loop per core, pinned there, takes the rest: each loop in a cgroup of its own whose CPU
# quota is (1 - SHARE) of a core in 10 ms periods, and whose weight is the highest, so that it gets that
# quota however many of COMMAND's threads are runnable there (at the default weight, a process that started
# many threads starved the loops: its engine ran at full speed). COMMAND gets SHARE of each core whether the
# other core is busy or not (a quota on COMMAND itself would let one process use the idle core's share).
# `make test-avx2 CPU_SHARE=0.4` uses it. Needs a writable cgroup CPU controller (root; v1 or v2).
set -euo pipefail

usage="usage: cpu_share.sh SHARE COMMAND... (SHARE: the fraction of each core's time left, 0 < SHARE < 1)"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
share=$1
shift
period=10000 # microseconds
quota=$(awk -v s="$share" -v p="$period" 'BEGIN { if (s > 0 && s < 1) printf "%d", (1 - s) * p }')
[ -n "$quota" ] || { echo "$usage" >&2; exit 2; }

if grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then # cgroup v2
  parent=/sys/fs/cgroup
  limit() { echo "$quota $period" >"$1/cpu.max" && echo 10000 >"$1/cpu.weight"; }
elif [ -w /sys/fs/cgroup/cpu ]; then # cgroup v1
  parent=/sys/fs/cgroup/cpu
  limit() { echo "$period" >"$1/cpu.cfs_period_us" && echo "$quota" >"$1/cpu.cfs_quota_us" && echo 262144 >"$1/cpu.shares"; }
else
  echo "cpu_share.sh: no writable cgroup CPU controller here (run as root, or leave CPU_SHARE unset)" >&2
  exit 1
fi

loops=()
groups=()
stop_loops() {
  kill "${loops[@]}" 2>/dev/null || true
  wait "${loops[@]}" 2>/dev/null || true
  for group in "${groups[@]}"; do rmdir "$group" 2>/dev/null || true; done
}
trap stop_loops EXIT
for ((core = 0; core < $(nproc); core++)); do
  group=$parent/kvpolicy-cpu-share-$$-$core
  mkdir "$group" && groups+=("$group") && limit "$group"
  taskset -c "$core" bash -c "echo \$\$ >$group/cgroup.procs && while :; do :; done" &
  loops+=($!)
done
"$@"
