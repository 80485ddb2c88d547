"""Calls: the layer of ``lightning_distgrad.rpc`` between the transport and RRefs.

The agent (``agent``) sends requests and routes the frames that arrive; ``serving`` runs a
request and answers it; ``dispatch`` holds the current agent and checks and sends a call;
``waiting`` is how a thread waits for a response (by driving MPI progress); ``payload``
pickles a call's objects around its tensors; ``one_way`` registers the library's own one-way
messages; ``autograd_hooks`` is the seam to distributed autograd; ``graceful_shutdown`` ends a job
without losing a message; ``spans``, ``remote_events`` and
``server_profiler`` record calls for profilers.
"""
