"""Run PyTorch's own RPC test suite against ``lightning_distgrad``, under MPI.

The test classes of the installed torch (``RpcTest``, ``DistAutogradTest``,
``DistOptimizerTest``, ``RemoteModuleTest``, the examples, torch's DDP under distributed
autograd, ...; the CUDA classes where torch sees a GPU) run with ``torch.distributed.rpc`` and
friends resolved to this package (see ``_suite.py``) in jobs of each class's ``world_size``
ranks (4, or 2 and 3 for the RemoteModule classes, 6 for ``DdpUnderDistAutogradTest``), MPI
rank r playing ``self.rank``. The classes of one world size share their jobs: every test
restores a fresh copy of torch's RPC modules and gets its own rendezvous file, as in a
process of its own, and a job's start (4 processes importing torch's test harness) costs
more than most classes' tests.
The package under test is the one in the CURRENT DIRECTORY::

    cd <checkout> && python tests/torch_suite/run_suite.py                    # everything
    python tests/torch_suite/run_suite.py -k RpcTest.test_self_add            # one test
    python tests/torch_suite/run_suite.py -k 'DistOptimizerTest.*'            # one class
    python tests/torch_suite/run_suite.py -k 'RpcTest.test_*rref*' -k sparse  # globs, substrings
    python tests/torch_suite/run_suite.py --list -k profiler                  # list only

``-k`` (repeatable): a pattern with a dot is a glob over the whole ``Class.test_name``;
one without is a substring of it (``-k RpcTest`` also selects ``TensorPipeAgentRpcTest``).

A test that runs longer than ``--hang-timeout`` seconds (default 90) ends its job (every
thread's stack is in the per-rank log first); a rank that dies ends its job too. That test
is reported ``hang`` or ``crash`` and the tests after it go on in a fresh job.

``excluded.txt`` (in this folder, one test a line, ``Class.test_name  reason``) lists the
tests not run. Each reason starts with one of ``internal:`` (tests a torch-internal object
or function, not public API), ``torchscript:``, ``dynamic-membership:``, ``fast-mode:``
(FAST-mode-only behaviour; the reason names the strict-mode test of ours that covers it, as
``tests/test_x.py::test_y``).

The run FAILS (exit code 1) when a test not excluded does not pass. Skipped tests (e.g.
CUDA ones that need more GPUs) neither pass nor fail. ``--include-excluded`` runs the
excluded tests too (and reports them; they do not fail the run).

Results: ``--out DIR`` (default: a new folder under $TMPDIR) gets ``report.json`` (every
test: class, outcome, seconds, traceback of each failing rank, exclusion reason), ``summary.txt``
(the table printed at the end: pass/fail/hang/crash/skip/excluded per class) and the
per-rank logs of each job (``ranks<n>.job<k>.rank<r>.out/err``).
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests/: mpi_launch

import mpi_launch  # noqa: E402

EXCLUDED = HERE / "excluded.txt"
EXCLUSION_KINDS = ("internal", "torchscript", "dynamic-membership", "fast-mode")
#: Outcomes that are not a pass (a skip is neither).
FAILED = ("fail", "hang", "crash")
#: Seconds the other ranks get to finish a test that one rank failed before the job is ended.
FAIL_GRACE_S = 15
#: Job numbers, unique in a run: a job's records and logs are named after it.
_JOB_NUMBERS = itertools.count(1)


@dataclass
class Result:
    test: str
    outcome: str  # pass, fail, hang, crash, skip, excluded
    seconds: float = 0.0
    detail: str = ""
    job: str = ""
    reason: str = ""  # why it is excluded


def read_list(path: Path) -> dict[str, str]:
    """``Class.test_name  reason`` lines (``#`` comments, blank lines allowed) -> {test: reason}."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test, _, reason = line.partition(" ")
        if not reason.strip() or test.count(".") != 1:
            raise SystemExit(f"{path}:{number}: expected 'Class.test_name  reason', got {line!r}")
        if test in entries:
            raise SystemExit(f"{path}:{number}: {test} is listed twice")
        entries[test] = reason.strip()
    return entries


def check_exclusions(excluded: dict[str, str], all_tests: set[str], repo: Path) -> None:
    """Stale or malformed entries are errors: the list must say exactly what is true."""
    problems = []
    for test, reason in excluded.items():
        if test not in all_tests:
            problems.append(f"excluded.txt: {test} is not a test of the suite")
        kind = reason.split(":", 1)[0]
        if kind not in EXCLUSION_KINDS or ":" not in reason:
            problems.append(
                f"excluded.txt: {test}: the reason must start with one of "
                f"{', '.join(k + ':' for k in EXCLUSION_KINDS)}"
            )
        elif kind == "fast-mode":
            covered = re.search(r"(tests/\S+\.py)::(\w+)", reason)
            if not covered:
                problems.append(f"excluded.txt: {test}: name the covering test, tests/x.py::test_y")
            elif not re.search(rf"def {covered.group(2)}\b", _read(repo / covered.group(1))):
                problems.append(f"excluded.txt: {test}: {covered.group(0)} does not exist")
    if problems:
        raise SystemExit("torch_suite: bad list entries:\n  " + "\n  ".join(problems))


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def select(all_tests: list[str], patterns: list[str]) -> list[str]:
    """Tests matching any pattern. A pattern with a dot is matched against the whole
    ``Class.test_name`` (a glob: ``RpcTest.test_self_add``, ``RpcTest.test_*rref*``);
    one without is a substring of it (``DistOptimizerTest``, ``sparse``)."""
    if not patterns:
        return list(all_tests)

    def matches(test: str, pattern: str) -> bool:
        if "." in pattern:
            return fnmatch.fnmatchcase(test, pattern)
        return pattern in test

    return [t for t in all_tests if any(matches(t, p) for p in patterns)]


def read_records(prefix: str, size: int) -> list[dict[str, dict]]:
    """Per rank: {test: {"start": record, "end": record}} from the worker's JSON lines."""
    per_rank: list[dict[str, dict]] = []
    for rank in range(size):
        seen: dict[str, dict] = {}
        path = Path(f"{prefix}.rank{rank}.jsonl")
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed rank
                seen.setdefault(rec["test"], {})[rec["event"]] = rec
        per_rank.append(seen)
    return per_rank


def combine(test: str, per_rank: list[dict[str, dict]]) -> Result | None:
    """The test's result once every rank ended it: any failing rank fails it, else a
    skipping rank skips it (as MultiProcessTestCase). None while a rank has not ended it."""
    ends = [seen.get(test, {}).get("end") for seen in per_rank]
    if any(e is None for e in ends):
        return None
    failing = [(r, e) for r, e in enumerate(ends) if e["outcome"] == "fail"]
    seconds = max(e["seconds"] for e in ends)
    if failing:
        detail = "\n".join(f"--- rank {r}:\n{e['detail']}" for r, e in failing)
        return Result(test, "fail", seconds, detail)
    skipping = [e for e in ends if e["outcome"] == "skip"]
    if skipping:
        return Result(test, "skip", seconds, skipping[0]["detail"])
    notes = "; ".join(sorted({e["settled"] for e in ends if e.get("settled")}))
    return Result(test, "pass", seconds, notes)


def run_tests(
    world_size: int,
    tests: list[str],
    opts: argparse.Namespace,
    out: Path,
    launcher: mpi_launch.Launcher,
) -> list[Result]:
    """Run ``tests`` on ``world_size`` ranks in as few jobs as hangs and crashes allow."""
    results: list[Result] = []
    remaining = list(tests)
    while remaining:
        name = f"ranks{world_size}.job{next(_JOB_NUMBERS)}"
        prefix = str(out / name)
        Path(prefix + ".tests.json").write_text(json.dumps(remaining))
        argv = [
            sys.executable,
            "-m",
            "mpi4py",
            str(HERE / "_worker.py"),
            "--tests",
            prefix + ".tests.json",
            "--records",
            prefix,
            "--hang-timeout",
            str(opts.hang_timeout),
        ]
        # The launcher's own timeout is a backstop only; hangs are caught per test below.
        backstop = int(opts.hang_timeout * (len(remaining) + 2) + 600)
        cmd, env = mpi_launch.command(launcher, world_size, argv, prefix, backstop)
        # Ranks write their own logs; the launcher's few lines go to this process's output.
        job = mpi_launch.Job(cmd, cwd=os.getcwd(), env=mpi_launch.job_env(env), capture=False)
        try:
            stopped, why, first_seen = _watch(job, remaining, prefix, world_size, opts.hang_timeout)
        except BaseException:  # interrupted or terminated: the job must not outlive us
            job.wait(timeout_s=0)  # SIGTERM first: mpiexec then ends its proxies too
            raise
        job_result = job.wait(timeout_s=None)
        if launcher.kind == "openmpi":
            mpi_launch._rename_prrte_logs(prefix)
        per_rank = read_records(prefix, world_size)
        done = 0
        for test in remaining:
            result = combine(test, per_rank)
            if result is None:
                break
            result.job = name
            results.append(result)
            report_progress(result)
            done += 1
        remaining = remaining[done:]
        if not remaining:
            break
        test = remaining.pop(0)
        started = any(test in seen for seen in per_rank)
        if not started and done == 0:
            raise SystemExit(
                f"torch_suite: job {name} ended before its first test started"
                f" (exit code {job_result.code}). Rank logs: {prefix}.rank<r>.out/err"
            )
        if test == stopped and why == "hang":
            result = Result(test, "hang", opts.hang_timeout, f"ran over {opts.hang_timeout} s")
        elif test == stopped:
            failed = _failed_ranks(test, per_rank)
            result = Result(
                test,
                "fail",
                time.monotonic() - first_seen[test],
                "\n".join(f"--- rank {r}:\n{rec['detail']}" for r, rec in failed)
                + f"\nthe other ranks had not finished {FAIL_GRACE_S} s later: job ended",
            )
        else:
            finished = [r for r, seen in enumerate(per_rank) if "end" in seen.get(test, {})]
            result = Result(
                test,
                "crash",
                time.monotonic() - first_seen.get(test, time.monotonic()),
                f"the job ended (exit code {job_result.code}) during the test; ranks"
                f" {finished} had finished it.",
            )
        result.detail += f"\nrank logs: {prefix}.rank<r>.out/err"
        result.job = name
        results.append(result)
        report_progress(result)
    return results


def _failed_ranks(test: str, per_rank: list[dict[str, dict]]) -> list[tuple[int, dict]]:
    """Ranks whose run of ``test`` failed (known before they settle), with their records."""
    return [
        (r, seen[test]["result"])
        for r, seen in enumerate(per_rank)
        if seen.get(test, {}).get("result", {}).get("outcome") == "fail"
    ]


def _watch(
    job: mpi_launch.Job, tests: list[str], prefix: str, world_size: int, hang_timeout: float
) -> tuple[str | None, str, dict[str, float]]:
    """Follow the job's records until it ends. End it when a test runs over ``hang_timeout``
    ("hang"), or when a rank failed a test and the others have not finished it
    ``FAIL_GRACE_S`` later ("fail": they wait for the failed rank, as MultiProcessTestCase
    ends the other processes at a first failure).

    Returns the test that ended the job (or None), why, and when each test was seen to start.
    """
    first_seen: dict[str, float] = {}
    failed_at: dict[str, float] = {}
    while True:
        ended = job.proc.poll() is not None
        per_rank = read_records(prefix, world_size)
        now = time.monotonic()
        running = None
        for test in tests:  # the first test not ended on every rank
            if combine(test, per_rank) is not None:
                continue
            if any(test in seen for seen in per_rank):
                first_seen.setdefault(test, now)
                running = test
            break
        if ended:
            return None, "", first_seen
        if running and now - first_seen[running] > hang_timeout:
            job.wait(timeout_s=0)  # ends the job now, as hung
            return running, "hang", first_seen
        if running and _failed_ranks(running, per_rank):
            if now - failed_at.setdefault(running, now) > FAIL_GRACE_S:
                job.wait(timeout_s=0)
                return running, "fail", first_seen
        time.sleep(0.5)


def report_progress(result: Result) -> None:
    print(f"{result.outcome:5s} {result.seconds:7.1f} s  {result.test}", flush=True)


def summarize(results: list[Result], classes: list[str]) -> str:
    """Per class: how many tests passed, failed, hung, ... ."""
    columns = ["pass", "fail", "hang", "crash", "skip", "excluded"]
    rows = []
    totals: Counter[str] = Counter()
    for name in classes:
        counts: Counter[str] = Counter()
        for r in results:
            if r.test.split(".")[0] != name:
                continue
            counts[r.outcome] += 1
        if counts:
            rows.append((name, counts))
            totals.update(counts)
    rows.append(("total", totals))
    width = max(len(n) for n, _ in rows)
    lines = [f"{'class':{width}s} " + " ".join(f"{c:>8s}" for c in columns)]
    for name, counts in rows:
        lines.append(f"{name:{width}s} " + " ".join(f"{counts[c]:8d}" for c in columns))
    lines.append(
        "(excluded: on excluded.txt, not run; with --include-excluded, counted by outcome)"
    )
    return "\n".join(lines)


def verdict(results: list[Result]) -> list[str]:
    """What makes the run fail: a test not excluded that did not pass."""
    return [f"{r.outcome}: {r.test}" for r in results if r.outcome in FAILED and not r.reason]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run tests whose Class.test_name matches: with a dot, a glob over the"
        " whole name; without, a substring. Repeatable",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=90.0,
        help="seconds one test may run before its job is ended (default 90)",
    )
    parser.add_argument("--out", help="folder for the report and logs (default: a new temp one)")
    parser.add_argument("--list", action="store_true", help="list the selected tests and exit")
    parser.add_argument(
        "--include-excluded", action="store_true", help="also run the tests on excluded.txt"
    )
    parser.add_argument(
        "--alone",
        action="store_true",
        help="run each test in a job of its own (slow: a job starts in about 30 s)",
    )
    opts = parser.parse_args(argv)
    # Terminated like interrupted: the running job is ended on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wall_start = time.monotonic()

    sys.path.insert(0, os.getcwd())
    import _suite

    suite = _suite.load(bind=False)  # the names only; each job binds its own
    all_tests = [f"{c}.{t}" for c, sc in suite.items() for t in sc.test_names()]
    excluded = read_list(EXCLUDED)
    check_exclusions(excluded, set(all_tests), HERE.parent.parent)
    selected = select(all_tests, opts.k)
    if opts.list:
        for test in selected:
            reason = excluded.get(test)
            print(test + (f"  [{reason}]" if reason else ""))
        return 0
    if not selected:
        print("torch_suite: no test matches", opts.k, file=sys.stderr)
        return 2
    launcher = mpi_launch.find_launcher()
    if launcher is None:
        print("torch_suite: no MPI launcher found (set MPIEXEC)", file=sys.stderr)
        return 2
    out = Path(opts.out or tempfile.mkdtemp(prefix="torch_suite."))
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"torch_suite: {len(selected)} tests; package under test: {os.getcwd()};"
        f" logs and report in {out}",
        flush=True,
    )

    results: list[Result] = []
    by_world_size: dict[int, list[str]] = {}  # in the order of the classes
    for test in selected:
        if test in excluded and not opts.include_excluded:
            results.append(Result(test, "excluded", reason=excluded[test]))
        else:
            by_world_size.setdefault(suite[test.split(".")[0]].world_size, []).append(test)
    for world_size, to_run in by_world_size.items():
        # --alone: each test in a job of its own, as torch runs it (a fresh process).
        for batch in [[t] for t in to_run] if opts.alone else [to_run]:
            results.extend(run_tests(world_size, batch, opts, out, launcher))
    for r in results:
        r.reason = excluded.get(r.test, "")

    wall = time.monotonic() - wall_start
    summary = summarize(results, list(suite))
    problems = verdict(results)
    unexpected = [r for r in results if f"{r.outcome}: {r.test}" in problems]
    text = [summary, f"wall time {wall:.0f} s; package under test: {os.getcwd()}"]
    for r in unexpected:
        text.append(f"\n=== {r.outcome}: {r.test} ({r.job})\n{r.detail.rstrip()}")
    text.append("\n" + ("\n".join(problems) if problems else "no unexpected results"))
    (out / "summary.txt").write_text("\n".join(text) + "\n")
    (out / "report.json").write_text(
        json.dumps(
            {
                "package": os.getcwd(),
                "launcher": launcher.describe(),
                "wall_s": round(wall),
                "hang_timeout_s": opts.hang_timeout,
                "patterns": opts.k,
                "results": [vars(r) for r in results],
            },
            indent=1,
        )
    )
    print("\n" + "\n".join(text))
    print(f"\ntorch_suite: report in {out}/summary.txt and report.json")
    if problems:
        print("torch_suite: FAILED", flush=True)
        return 1
    print("torch_suite: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
