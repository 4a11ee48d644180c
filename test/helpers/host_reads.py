"""Counting host reads (values read back from a tensor's device) in a block of code:
each is a device-to-host round trip and a pipeline stall on a GPU."""

from __future__ import annotations

from collections import Counter

from torch.overrides import TorchFunctionMode

# Tensor methods that need the value on the host: on a GPU each one waits for the queue
# (`.numpy()` is not counted: it raises on a CUDA tensor, so on the hot path it always
# follows a `.cpu()`, which is)
HOST_READS = frozenset({"item", "cpu", "tolist", "__float__", "__int__", "__bool__",
                        "__index__"})


class HostReads(TorchFunctionMode):
    """Counts the host reads made on tensors while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))
