"""SMART vs strict backward passes, and routed remote experts vs the same model locally.

Rank 0 drives; ranks 1 and 2 hold two experts each (16x16, 32 tokens, top-1 routing).
Cases: the design note's 3x3 iteration; ``moe-all``, every expert gets tokens; ``moe-partial``,
two get none and their RPC results go unused. SMART's gradients must match the local model's."""

from statistics import median

import torch
from _harness import Stack, parse, row, run, sample
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
    gate_all = torch.eye(WIDTH, EXPERTS).requires_grad_()
    every, half = torch.ones(EXPERTS, dtype=torch.bool), torch.tensor([True, False] * 2)
    return {"moe-all": (gate_all, ws, x_all, every), "moe-partial": (gate, ws, x, half)}


def cases(s: Stack) -> dict[str, dict]:
    """Each case's variants; SMART's gradients checked against the local model's."""
    t1, t2 = inputs(3)
    note = lambda strict: iteration(s.rpc, s.autograd, t1, t2, strict=strict)  # noqa: E731
    check(note(False), t1, t2, "SMART note")
    out = {
        "design-note iteration 3x3": {"SMART": lambda: note(False), "strict": lambda: note(True)}
    }
    for name, m in models().items():
        got = remote_moe(s, *m, strict=False)
        for t, e in zip([m[0], *m[1]], local_moe(*m), strict=True):
            zero = torch.zeros_like(t)  # what an expert without tokens gets
            torch.testing.assert_close(got.get(t, zero), zero if e is None else e, msg=name)
        out[name] = {"SMART": lambda m=m: remote_moe(s, *m, strict=False)}
        if name == "moe-all":  # a strict pass refuses moe-partial's unused results
            out[name]["strict"] = lambda m=m: remote_moe(s, *m, strict=True)
        out[name]["local model"] = lambda m=m: local_moe(*m)
    return out


def measure(comm, args) -> tuple[list[dict] | None, dict]:
    with Stack("ours", comm) as s:
        if comm.Get_rank() != 0:
            return None, {}
        rows, iters = [], 60 if args.quick else 300
        for name, variants in cases(s).items():
            times: dict = {v: [] for v in variants}
            for i in range(iters + 20):
                for v, fn in list(variants.items())[:: 1 if i % 2 else -1]:
                    times[v] += sample(fn, 1, warmup=0)
            smart = median(times.pop("SMART")[20:])  # the first 20 rounds warm up
            for v, t in times.items():
                target = ("<=", 1.05) if v == "strict" else None
                rows.append(row(f"{name}, SMART", smart, median(t[20:]), v, "s", target))
        return rows, {}


if __name__ == "__main__":
    run("smart", 3, measure, parse(__doc__))
