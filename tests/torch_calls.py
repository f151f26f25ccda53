"""The torch operators a stretch of code dispatches, by name, for the tests and benchmarks that check what a
forward costs the host: on a GPU each call that is not a view is a kernel launch or a copy of its own.

    with TorchCalls(outside=model) as calls:   # not counted: the model's own forward (its hooks say when)
        session.tree_rows(prefix, tree)
    calls.work()                               # the calls that are not views
"""

from __future__ import annotations

import contextlib
from typing import Any

VIEWS = frozenset({"slice", "select", "view", "alias", "detach", "detach_", "unsqueeze", "as_strided", "expand",
                   "resolve_conj", "resolve_neg", "lift_fresh", "reshape", "_unsafe_view"})  # no device work
# what waits for the device on the host (a read of a device value, or an output whose shape depends on the data:
# its size is read first); a CUDA graph's capture fails on any of them
HOST_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select",
                        "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave", "tolist"})


class TorchCalls:
    """While open: every torch operator dispatched (:attr:`calls`, by name, in order), except inside the forward of
    ``outside`` (a module; counted again once it returns) and while :meth:`pause` holds."""

    def __init__(self, outside: Any = None) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.calls: list[str] = []
        self._paused = 0
        self._hooks: list[Any] = []
        self._outside = outside

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._paused:
                    counter.calls.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def work(self) -> list[str]:
        """The calls that are not views (:data:`VIEWS`)."""
        return [c for c in self.calls if c not in VIEWS]

    def host_reads(self) -> list[str]:
        """The calls that wait for the device on the host (:data:`HOST_READS`)."""
        return [c for c in self.calls if c in HOST_READS]

    @contextlib.contextmanager
    def pause(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> TorchCalls:
        if self._outside is not None:
            def enter(module, args):
                self._paused += 1

            def leave(module, args, output):
                self._paused -= 1  # returns None: the output stays

            self._hooks = [self._outside.register_forward_pre_hook(enter), self._outside.register_forward_hook(leave)]
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
