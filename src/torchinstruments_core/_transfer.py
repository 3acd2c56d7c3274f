"""Move a sample's device scalars to the host in one transfer per device.

On CUDA the copy goes into pinned memory without blocking and an event says when it has landed, so
closing a sample never makes the training step wait for the device. Elsewhere the copy is
synchronous. On the CPU there is no copy: each tensor's values are read as they are (``tolist``
gives the floats a float64 copy would; a count or a flag becomes the same float in Python).
A sample has a few hundred such small tensors, and converting, concatenating and reading them
back cost the training thread half a millisecond.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence


def _host_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps float64 statistics exact; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


class HostTransfer:
    """The host copy of a list of small 1-D device tensors, possibly still in flight.

    Args:
        tensors: Device tensors; ``wait()`` returns their values as host floats, in this order.
        events: CUDA events recorded before the copies (a profiled sample's time marks): the
            transfer is ready only once they have completed too, so their elapsed times can be
            read without waiting for the device.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], events: Sequence[torch.cuda.Event] = ()
    ) -> None:
        self._events = list(events)
        self._sizes = [t.numel() for t in tensors]
        self._groups: list[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = []
        self._host: list[tuple[int, torch.Tensor]] = []  # on the CPU already: read in ``wait``
        by_device: dict[torch.device, list[int]] = {}
        for index, tensor in enumerate(tensors):
            if tensor.device.type == "cpu":
                self._host.append((index, tensor))
            else:
                by_device.setdefault(tensor.device, []).append(index)
        for device, indices in by_device.items():
            flat = torch.cat([tensors[i].reshape(-1).to(_host_dtype(device)) for i in indices])
            self._groups.append((indices, *_copy_to_host(flat)))

    def ready(self) -> bool:
        """Whether every copy has landed (never blocks)."""
        copies = (event for _, _, event in self._groups if event is not None)
        return all(event.query() for event in (*copies, *self._events))  # type: ignore[no-untyped-call]

    def wait(self) -> list[list[float]]:
        """Block until the copies have landed; return each input tensor's values."""
        out: list[list[float]] = [[] for _ in self._sizes]
        for index, tensor in self._host:
            # a torch call apiece costs microseconds: a 0-d or 1-D tensor (a count, a reducer's
            # result) is read as it is, a count or a flag converted in Python, as float64 would
            flat = tensor if tensor.dim() <= 1 else tensor.reshape(-1)
            values = flat.tolist()
            values = values if isinstance(values, list) else [values]
            out[index] = values if flat.is_floating_point() else [float(v) for v in values]
        for indices, host, event in self._groups:
            if event is not None:
                event.synchronize()
            values = host.tolist()
            offset = 0
            for index in indices:
                out[index] = values[offset : offset + self._sizes[index]]
                offset += self._sizes[index]
        for event in self._events:  # completed already unless flush waits for the device
            if not event.query():  # type: ignore[no-untyped-call]
                event.synchronize()
        return out


def _copy_to_host(flat: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    if flat.device.type != "cuda":
        return flat.cpu(), None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(flat.device))
    return host, event
