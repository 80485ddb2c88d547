"""RRefs above calls: each process's bookkeeping of owned values and their forks
(``bookkeeping``), what RPCs to an owner run there (``owner_side``), and method proxies
(``proxies``). The ``RRef`` class itself is in ``rpc.rref``."""
