r"""The pipeline example with one timeline of the whole job: every rank profiled, merged.

Run with (rank 0 trains, rank 1 serves the remote half)::

    mpiexec -n 2 python -m mpi4py examples/profile_pipeline.py

Every rank enters :func:`lightning_distgrad.profiler.profile` around the same ``fit`` (on the
serving rank ``fit`` serves), so the trace covers both sides of each step: the trainer's
forward RPCs and backward pass, the server's runs of them, and an arrow for every message.
Rank 0 writes ``pipeline_trace.json`` (open it in https://ui.perfetto.dev or
``chrome://tracing``) and draws it as ``pipeline_timeline.png``. A few steps are enough:
``--max-steps`` defaults to 5 here; ``--out DIR`` chooses where the files go.
"""

from __future__ import annotations

import os

import lightning as L
from _lightning_utils import lightning_parser, loaders, make_trainer
from lightning_pipeline import PipelineModel, make_dataset

from lightning_distgrad import DistAutogradStrategy, profiler


def main(argv: list[str] | None = None) -> str | None:
    """Profile a few training steps; returns the trace's path on rank 0, None elsewhere."""
    parser = lightning_parser(__doc__, lr=0.2)
    parser.add_argument("--out", default=".", help="folder for the trace and the picture")
    parser.set_defaults(max_steps=5, fast=True, epochs=1)
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    train, val = loaders(make_dataset, 512, args.batch_size)
    trainer, _ = make_trainer(DistAutogradStrategy(num_servers=1), args)
    trace = os.path.join(args.out, "pipeline_trace.json")
    with profiler.profile(trace):
        trainer.fit(PipelineModel(lr=args.lr), train, val)
    if not trainer.is_global_zero:
        return None
    picture = os.path.join(args.out, "pipeline_timeline.png")
    profiler.plot_timeline(trace, picture)
    print(f"wrote {trace} and {picture}", flush=True)
    return trace


if __name__ == "__main__":
    main()
