"""SMART vs strict backward passes, and routed remote experts vs the same model locally.

Rank 0 drives; ranks 1 and 2 hold two experts each (16x16 weights, 32 tokens of width 16,
top-1 routing). Cases: the design note's 3x3 iteration; ``moe-all``, routing forced to
give every expert tokens; ``moe-partial``, two experts get none and their RPC results go
unused (a strict pass refuses that). Variants alternate; SMART's gradients must match the
local model's.
"""

import time
from statistics import median

import torch
from _harness import Stack, finish, parse, row, world
from design_note import check, inputs, iteration

WIDTH, TOKENS, EXPERTS = 16, 32, 4


def expert(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def moe_loss(gate, ws, x, allowed, call) -> torch.Tensor:
    probs, top = (x @ gate).masked_fill(~allowed, float("-inf")).softmax(-1).max(-1)
    outs = [call(i, x, w) for i, w in enumerate(ws)]
    y = torch.zeros(TOKENS, WIDTH)
    for i in top.unique().tolist():
        rows = (top == i).nonzero().squeeze(1)
        y = y.index_add(0, rows, outs[i][rows] * probs[rows, None])
    return y.pow(2).sum()


def remote_moe(s: Stack, gate, ws, x, allowed, strict: bool) -> dict:
    with s.autograd.context() as ctx:
        call = lambda i, x, w: s.rpc.rpc_sync(f"worker{1 + i % 2}", expert, (x, w))  # noqa: E731
        s.autograd.backward(ctx, [moe_loss(gate, ws, x, allowed, call)], strict=strict)
        return s.autograd.get_gradients(ctx)


def local_moe(gate, ws, x, allowed) -> tuple:
    loss = moe_loss(gate, ws, x, allowed, lambda i, x, w: expert(x, w))
    return torch.autograd.grad(loss, [gate, *ws], allow_unused=True)


def models() -> dict[str, tuple]:
    torch.manual_seed(0)
    ws = [torch.rand(WIDTH, WIDTH, requires_grad=True) for _ in range(EXPERTS)]
    x, gate = torch.rand(TOKENS, WIDTH), torch.rand(WIDTH, EXPERTS, requires_grad=True)
    x_all = x.clone()  # a large bias routes a quarter of the tokens to each expert
    x_all[:, :EXPERTS] += torch.eye(EXPERTS).repeat(TOKENS // EXPERTS, 1) * 100
    gate_all = torch.zeros(WIDTH, EXPERTS)
    gate_all[:EXPERTS] = torch.eye(EXPERTS)
    every, half = torch.ones(EXPERTS, dtype=torch.bool), torch.tensor([True, False] * 2)
    gate_all.requires_grad_()
    return {"moe-all": (gate_all, ws, x_all, every), "moe-partial": (gate, ws, x, half)}


def run(s: Stack, iters: int) -> list[dict]:
    t1, t2 = inputs(3)
    check(iteration(s.rpc, s.autograd, t1, t2, strict=False), t1, t2, "SMART note")
    cases = {
        "design-note iteration 3x3": {
            "SMART": lambda: iteration(s.rpc, s.autograd, t1, t2, strict=False),
            "strict": lambda: iteration(s.rpc, s.autograd, t1, t2, strict=True),
        }
    }
    for name, m in models().items():
        got = remote_moe(s, *m, strict=False)
        for t, e in zip([m[0], *m[1]], local_moe(*m), strict=True):
            zero = torch.zeros_like(t)  # what an expert without tokens gets
            torch.testing.assert_close(got.get(t, zero), zero if e is None else e, msg=name)
        cases[name] = {"SMART": lambda m=m: remote_moe(s, *m, strict=False)}
        if name == "moe-all":
            cases[name]["strict"] = lambda m=m: remote_moe(s, *m, strict=True)
        cases[name]["local model"] = lambda m=m: local_moe(*m)
    rows = []
    for name, variants in cases.items():
        times: dict = {v: [] for v in variants}
        for i in range(iters + 20):  # the first 20 rounds warm up
            for v, fn in list(variants.items())[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                fn()
                if i >= 20:
                    times[v].append(time.perf_counter() - t0)
        smart = median(times.pop("SMART"))
        for v, t in times.items():
            target = ("<=", 1.1) if v == "strict" else None
            rows.append(row(f"{name}, SMART", smart, median(t), v, "s", target))
    return rows


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    comm = world("smart", 3)
    with Stack("ours", comm) as s:
        rows = run(s, 60 if args.quick else 300) if comm.Get_rank() == 0 else None
    finish("smart", rows, comm, args)


if __name__ == "__main__":
    main()
