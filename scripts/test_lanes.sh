#!/usr/bin/env bash
# The suite as `make test` runs it on a small machine: three lanes of pytest,
# timed so that the two cores stay busy without disturbing the tests that
# time the server against the wall clock.
#
#   phase 1   serial       the SERIAL modules alone at normal priority (they
#                          leave the cores ~40 % idle: sleeps, drains, one
#                          server thread)
#             background   beside them, at SCHED_IDLE priority, the BACKGROUND
#                          modules (in-process compute with no wall-clock
#                          deadline): they take only the cycles serial leaves
#   phase 2   parallel     everything else, two modules at a time
#             own process  beside it, the OWN_PROCESS modules (not for xdist)
#
# The lists live in tests/lanes.py; each lane's pytest is given its files, so
# it collects only those. The xdist lanes take their modules in the order
# given, longest first (--no-loadscope-reorder; tests/lanes.py says why).
# Usage: scripts/test_lanes.sh PYTHON
set -u
PY=${1:-.venv/bin/python}
serial_files=$("$PY" tests/lanes.py serial)
background_files=$("$PY" tests/lanes.py background)
own_files=$("$PY" tests/lanes.py own_process)
parallel_files=$("$PY" tests/lanes.py parallel)
background_log=$(mktemp)

# SCHED_IDLE: the kernel runs these only when no normal task wants the CPU,
# so a serial test's server sees the cores as if alone (it inherits the
# policy to every child: xdist workers, OpenMP threads, interpreter children).
# Where the policy is refused, the lowest nice value is the next best thing.
idle() {
    "$PY" - "$@" <<'PYTHON'
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError) as exc:
    print(f"test_lanes: SCHED_IDLE refused ({exc}); the background lane runs at nice 19", file=sys.stderr)
    os.nice(19)
os.execvp(sys.argv[1], sys.argv[1:])
PYTHON
}

status=0
own_log=$(mktemp)
trap 'rm -f "$background_log" "$own_log"' EXIT
OMP_NUM_THREADS=1 idle "$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $background_files \
    --durations=10 -p no:cacheprovider >"$background_log" 2>&1 &
background=$!
"$PY" -m pytest -q $serial_files --durations=10 -p no:cacheprovider || status=$?
wait "$background" || status=$?
echo "---- background lane (ran beside the serial phase) ----"
cat "$background_log"
echo "---- phase 1 took ${SECONDS} s; the parallel lane ----"
OMP_NUM_THREADS=1 "$PY" -m pytest -q $own_files --durations=5 -p no:cacheprovider \
    >"$own_log" 2>&1 &
own=$!
OMP_NUM_THREADS=1 "$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $parallel_files \
    -m "not serial and not background and not own_process" --durations=15 || status=$?
wait "$own" || status=$?
echo "---- own-process lane (ran beside the parallel lane) ----"
cat "$own_log"
echo "---- the lanes took ${SECONDS} s ----"
exit "$status"
