r"""The pipeline example with one timeline of the whole job: a few steps of every rank, merged.

Run with (rank 0 trains, rank 1 serves the remote half)::

    mpiexec -n 2 python -m mpi4py examples/profile_pipeline.py

A :class:`lightning_distgrad.profiler.TimelineCallback` records steps ``--start-step`` to
``--start-step + --num-steps - 1`` on every rank, the serving one included (trainer 0 asks it
to record), so the trace covers both sides of each step: the trainer's forward RPCs, its
backward pass and its gradient messages, the server's runs of them, and an arrow for every
message. Trainer 0 writes ``pipeline_trace.json`` (open it in https://ui.perfetto.dev or
``chrome://tracing``) and draws it as ``pipeline_timeline.png``; ``--out DIR`` chooses where
the files go. Training stops after ``--max-steps`` (default 5).
"""

from __future__ import annotations

import os

import lightning as L
from _lightning_utils import lightning_parser, loaders, make_trainer
from lightning_pipeline import PipelineModel, make_dataset

from lightning_distgrad import DistAutogradStrategy, profiler


def main(argv: list[str] | None = None) -> str | None:
    """Profile a few training steps; returns the trace's path on trainer 0, None elsewhere."""
    parser = lightning_parser(__doc__, lr=0.2)
    parser.add_argument("--out", default=".", help="folder for the trace and the picture")
    parser.add_argument("--start-step", type=int, default=2, help="first step recorded")
    parser.add_argument("--num-steps", type=int, default=2, help="steps recorded")
    parser.set_defaults(max_steps=5, fast=True, epochs=1)
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    train, val = loaders(make_dataset, 512, args.batch_size)
    trainer, _ = make_trainer(DistAutogradStrategy(num_servers=1), args)
    trace = os.path.join(args.out, "pipeline_trace.json")
    trainer.callbacks.append(profiler.TimelineCallback(trace, args.start_step, args.num_steps))
    trainer.fit(PipelineModel(lr=args.lr), train, val)
    if not trainer.is_global_zero:
        return None
    picture = os.path.join(args.out, "pipeline_timeline.png")
    profiler.plot_timeline(trace, picture)
    print(f"wrote {trace} and {picture}", flush=True)
    return trace


if __name__ == "__main__":
    main()
