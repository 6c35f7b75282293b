"""Tensor parallelism over `torch.distributed`: one model split over `tp_size` ranks.

- `parallel_state`: the process groups of one rank (`ParallelState`, passed down to the
  layers as an argument, never a global) and how a dimension is split across ranks.
- `communication`: all_reduce / all_gather / broadcast of one rank's tensors and objects.
- `step_sync`: rank 0 (the scheduler's process) broadcasts each step's `ForwardBatch`;
  the other ranks receive it and run the same forward.
- `tp_worker`: the process of a rank > 0 (load its shards, then the receive → forward loop).
- `launch`: the rendezvous address and the ranks' processes, for `runtime/launcher.py`.

This package's `__init__` and `launch` import no torch, so the front process can start ranks.
"""
