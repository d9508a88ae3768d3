"""``nccl-sim``: a process group with ProcessGroupNCCL's semantics, on CPU, for tests and benchmarks.

No two NCCL ranks can run where this project is built (a lent machine has one GPU, and NCCL
refuses two ranks on one device), yet recovery lives exactly where NCCL and gloo differ. This
backend wraps gloo (which moves the bytes) and behaves like ProcessGroupNCCL where it matters,
each behaviour as the torch source and NCCL's documentation describe it:

1. **Futures complete at enqueue.** ``WorkNCCL::wait`` only makes the current CUDA stream wait
   for the op's end event and returns at once; the host blocks later, at a *host sync* of a
   result (``.item()``, ``float()``, ``.cpu()``, ``cudaStreamSynchronize``). Here
   :meth:`SimWork.wait` returns at once, :meth:`SimWork.is_completed` says whether the op
   ended, and :func:`synchronize` is the host sync: it blocks until every op this process
   enqueued has ended. (``barrier`` is the exception: its wait synchronizes the device, as
   ``WorkNCCL::wait`` does for a barrier.)
2. **A dead peer hangs.** NCCL reports no error when a peer dies; its kernels spin. Where gloo
   fails an op at once (connection reset), the op here simply never ends, until the group is
   aborted or the watchdog acts.
3. **The watchdog.** ProcessGroupNCCL's watchdog thread checks every op against the group's
   timeout; what it does then is ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (ProcessGroupNCCL.hpp:
   ``SHOULD_CLEAN_UP``/``SHOULD_TEAR_DOWN``): 0 nothing (the op hangs on), 2 (CleanUpOnly)
   abort the communicator (the op's sync raises), 1 (TearDown) and 3 (SkipCleanUp, torch's
   default) take the process down (``std::abort``: here ``os.abort()``, after a line on stderr
   that names the op).
4. **abort().** ``ncclCommAbort``: every op of the group ends with an error at its sync, now.
5. **Lazy communicators.** Without ``device_id`` a group's communicator is made on its first
   collective, in the calling thread, and each pair's point-to-point communicator on the
   pair's first send/recv; :meth:`SimProcessGroup.eager_connect` makes the group's up front
   (``device_id`` / ``eager_connect_single_device``), :meth:`SimProcessGroup.connect_pair` a
   pair's. Each costs ``setup_seconds`` (``DYNATRAIN_NCCL_SIM_SETUP_SECONDS``, default 0), and
   :data:`SETUP` counts them, so a test can see where the cost fell.
6. **Ordered point-to-point.** NCCL matches a pair's sends and receives by order, not by tag;
   the recorder checks, for the k-th message from a to b, that both ends posted the same size
   (through the group's store), and raises :class:`OrderMismatch` naming both when they differ
   (gloo, matching by tag, would have carried on; NCCL would deliver the wrong bytes or hang).

**The device is the host.** On a CPU the code that follows a collective (the optimizer reading
the reduced gradients, the trainer reading the loss) runs at once, where on a GPU the stream
would run it after the op. So a group made with ``ordered=True`` (what the workers get: their
``--backend nccl-sim``, through :class:`~dynatrain.vps.generations.DeviceManager`) runs each op
to its end inside the call that enqueues it, as the stream would before any later work: the
training thread then blocks where a GPU worker's host would (its next host sync), and exactly
as unreachably: an op whose peer died holds it until the group is aborted or the watchdog acts.
``ordered=False`` keeps enqueue, ``wait()`` and :func:`synchronize` apart, for checks of code
that syncs by itself (``tests/vps/test_ncclsim.py``).

A test harness setting, never a fallback of the product: nothing chooses it unless asked.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
DEFAULT_ERROR_HANDLING = 3
"""torch's default (SkipCleanUp): a timed-out op takes the process down."""
SETUP_ENV = "DYNATRAIN_NCCL_SIM_SETUP_SECONDS"
POLL_SECONDS = 0.005


class SimNcclError(RuntimeError):
    """An op of an aborted group (``ncclCommAbort``, or the watchdog in CleanUpOnly mode)."""


class OrderMismatch(RuntimeError):
    """The two ends of a pair posted their k-th point-to-point op with different sizes."""


@dataclass
class _Op:
    group: "SimProcessGroup"
    what: str
    inner: object
    start: float = field(default_factory=time.monotonic)
    ended: bool = False
    check: object = None
    """Called once the op ended (the order recorder's check of a receive); may raise."""
    error: Exception | None = None
    waited: threading.Event | None = None
    """Point-to-point: gloo progresses a send or receive only inside ``wait()``, so a thread
    of its own waits on it and sets this once it ended well (a failure leaves it unset: the
    op hangs, as it would under NCCL)."""


_lock = threading.Lock()
_outstanding: list[_Op] = []
_watchdog: threading.Thread | None = None
SETUP: dict[str, float] = {"count": 0, "seconds": 0.0}
"""Communicators made so far in this process, and the seconds they cost (lazy or eager)."""


def error_handling() -> int:
    """The watchdog's mode, from the environment as ProcessGroupNCCL reads it."""
    value = os.environ.get(ERROR_HANDLING, "")
    try:
        return int(value) if value else DEFAULT_ERROR_HANDLING
    except ValueError:
        raise ValueError(f"{ERROR_HANDLING}={value!r} is not one of 0, 1, 2, 3") from None


def _inner_done(op: _Op) -> bool:
    """The wrapped gloo op ended well. One that failed (a dead peer) never ends: NCCL hangs."""
    w = op.inner
    if op.waited is not None:
        ok = op.waited.is_set()
    elif not w.is_completed():
        return False
    else:
        try:
            ok = w.is_success()
        except Exception:
            return False
    if ok and op.check is not None:
        check, op.check = op.check, None
        try:
            check()
        except Exception as e:            # raised where the op is synced or waited on
            op.error = e
    return ok


class SimWork(dist.Work):
    """A ProcessGroupNCCL work: :meth:`wait` does not block the host."""

    def __init__(self, op: _Op, *, blocking: bool = False):
        super().__init__()
        self._op, self._blocking = op, blocking

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._blocking:                      # barrier: a device synchronize
            _sync_ops([self._op])
        elif self._op.group.aborted is not None:
            raise SimNcclError(self._op.group.aborted)
        elif self._op.error is not None:
            raise self._op.error
        return True

    def is_completed(self) -> bool:
        return self._op.group.aborted is not None or _inner_done(self._op)

    def is_success(self) -> bool:
        return _inner_done(self._op)

    def exception(self):
        return None

    def get_future(self):
        return self._op.inner.get_future()


def _sync_ops(ops: list[_Op]) -> None:
    while True:
        waiting = []
        for op in ops:
            if op.group.aborted is not None:
                raise SimNcclError(f"{op.what}: {op.group.aborted}")
            if not op.ended and _inner_done(op):
                op.ended = True
            if op.error is not None:
                raise op.error
            if not op.ended:
                waiting.append(op)
        if not waiting:
            return
        ops = waiting
        time.sleep(POLL_SECONDS)


def synchronize() -> None:
    """The host sync: block until every op this process enqueued has ended (like
    ``cudaDeviceSynchronize`` before a result is read); raise :class:`SimNcclError` if one's
    group was aborted. A peer that died makes this block until an abort or the watchdog."""
    with _lock:
        ops = list(_outstanding)
    _sync_ops(ops)
    with _lock:
        _outstanding[:] = [op for op in _outstanding if not op.ended]


def _watch() -> None:
    while True:
        time.sleep(0.05)
        now = time.monotonic()
        with _lock:
            for op in _outstanding:
                if not op.ended and _inner_done(op):
                    op.ended = True
            _outstanding[:] = [op for op in _outstanding if not op.ended]
            late = [op for op in _outstanding if op.group.aborted is None
                    and now - op.start > op.group.op_timeout.total_seconds()]
        if not late:
            continue
        mode = error_handling()
        op = late[0]
        text = (f"[nccl-sim watchdog] {op.what} on group {op.group.label or '?'} (rank "
                f"{op.group.rank()} of {op.group.size()}) ran {now - op.start:.1f} s, past "
                f"its timeout of {op.group.op_timeout.total_seconds():g} s")
        if mode in (1, 3):
            print(f"{text}; {ERROR_HANDLING}={mode}: taking the process down",
                  file=sys.stderr, flush=True)
            os.abort()
        if mode == 2:
            for o in late:
                o.group.abort(f"the watchdog aborted the communicator: {o.what} passed "
                              f"its timeout ({ERROR_HANDLING}=2)")
        # mode 0: nothing; the ops hang on


def _start_watchdog() -> None:
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="nccl-sim-watchdog", daemon=True)
            _watchdog.start()


class SimProcessGroup(dist.ProcessGroup):
    """A group of ``size`` ranks over ``store`` with ProcessGroupNCCL's semantics (see the
    module docstring); the bytes travel over a gloo group of the same members."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, *, name: str = "",
                 setup_seconds: float | None = None, eager: bool = False,
                 ordered: bool = False):
        super().__init__(rank, size)
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._store = dist.PrefixStore("nccl-sim-order", store)
        # Not "name"/"timeout": ProcessGroup has a name() method that the trainer calls.
        self.op_timeout, self.label = timeout, name
        self.setup_seconds = (float(os.environ.get(SETUP_ENV, "0") or 0)
                              if setup_seconds is None else setup_seconds)
        self.aborted: str | None = None
        self.ordered = ordered
        self._ready: set = set()
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        # Receive checks not yet run, per peer, by message index: a receive that ends runs
        # every earlier one first, so a mismatch is always named at its first message, in
        # whichever order the watchdog and the waits see the receives end.
        self._unchecked: dict[int, dict[int, object]] = {}
        self._check_lock = threading.Lock()
        _start_watchdog()
        if eager:
            self.eager_connect()

    def getBackendName(self) -> str:        # noqa: N802 (torch's name)
        return "nccl-sim"

    def name(self) -> str:
        return "nccl-sim"

    # -- communicators ------------------------------------------------------------------------
    def _connect(self, key, *, first_use: bool = True) -> None:
        if key in self._ready:
            return
        if first_use:          # said, so that a run can show where its setup cost fell
            what = "its communicator" if key == "group" else \
                f"its point-to-point communicator with rank {key[1]}"
            print(f"nccl-sim: group {self.label or '?'} (rank {self.rank()}) made {what} at "
                  f"first use ({self.setup_seconds:g} s)", file=sys.stderr, flush=True)
        if self.setup_seconds:
            time.sleep(self.setup_seconds)
        self._ready.add(key)
        with _lock:
            SETUP["count"] += 1
            SETUP["seconds"] += self.setup_seconds

    def eager_connect(self) -> None:
        """The group's communicator now (``device_id``), not at its first collective."""
        self._connect("group", first_use=False)

    def eager_connect_single_device(self, device=None) -> None:
        """ProcessGroupNCCL's name for :meth:`eager_connect`."""
        self.eager_connect()

    def connect_pair(self, peer: int) -> None:
        """The point-to-point communicator with ``peer`` now, not at the first send/recv."""
        self._connect(("pair", peer), first_use=False)

    # -- ops ----------------------------------------------------------------------------------
    def _enqueue(self, what: str, inner, *, blocking: bool = False, check=None,
                 p2p: bool = False) -> SimWork:
        op = _Op(self, what, inner, check=check)
        if p2p:
            op.waited = threading.Event()

            def progress():
                try:
                    inner.wait()
                except Exception:              # a dead peer: under NCCL, a hang
                    return
                op.waited.set()
            threading.Thread(target=progress, name=f"nccl-sim {what}", daemon=True).start()
        if self.ordered:                   # the device is the host: the op runs to its end
            with _lock:
                _outstanding.append(op)
            _sync_ops([op])
            return SimWork(op, blocking=blocking)
        with _lock:
            _outstanding.append(op)
        return SimWork(op, blocking=blocking)

    def _usable(self, what: str) -> None:
        if self.aborted is not None:
            raise SimNcclError(f"{what} on an aborted communicator: {self.aborted}")

    def allreduce(self, tensors, opts=None):
        self._usable("allreduce")
        self._connect("group")
        inner = self._inner.allreduce(tensors) if opts is None else \
            self._inner.allreduce(tensors, opts)
        return self._enqueue("allreduce", inner)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._usable("allgather")
        self._connect("group")
        inner = self._inner.allgather(output_tensors, input_tensors) if opts is None else \
            self._inner.allgather(output_tensors, input_tensors, opts)
        return self._enqueue("allgather", inner)

    def broadcast(self, tensors, opts=None):
        self._usable("broadcast")
        self._connect("group")
        inner = self._inner.broadcast(tensors) if opts is None else \
            self._inner.broadcast(tensors, opts)
        return self._enqueue("broadcast", inner)

    def barrier(self, opts=None):
        self._usable("barrier")
        self._connect("group")
        return self._enqueue("barrier", self._inner.barrier(), blocking=True)

    def _record_send(self, peer: int, nbytes: int, tag: int) -> None:
        """The order recorder, sender's side: its k-th message to ``peer`` (size, tag)."""
        k = self._sent.get(peer, 0)
        self._sent[peer] = k + 1
        self._store.set(f"{self.rank()}->{peer}/{k}", f"{nbytes} bytes, tag {tag}")

    def _receive_check(self, peer: int, nbytes: int, tag: int):
        """The order recorder, receiver's side: once the k-th receive from ``peer`` has
        ended (the sender recorded its k-th send before posting it), the sizes must agree.
        The returned check runs the pair's unchecked earlier receives first, in order."""
        k = self._received.get(peer, 0)
        self._received[peer] = k + 1
        key, me = f"{peer}->{self.rank()}/{k}", self.rank()
        mine = f"{nbytes} bytes, tag {tag}"

        def compare():
            sent = self._store.get(key).decode()
            if sent != mine:
                raise OrderMismatch(
                    f"group {self.label or '?'}: message {k} from rank {peer} to rank {me} was "
                    f"posted as {sent} by the sender and {mine} by the receiver: NCCL matches "
                    "a pair's messages by their order (tags are ignored), so both ends must "
                    "post them in the same order")

        with self._check_lock:
            self._unchecked.setdefault(peer, {})[k] = compare

        def check():
            with self._check_lock:
                pending = self._unchecked.get(peer, {})
                due = [pending.pop(i) for i in sorted(i for i in pending if i <= k)]
            for one in due:
                one()
        return check

    def send(self, tensors, dst: int, tag: int = 0):
        self._usable("send")
        self._connect(("pair", dst))
        self._record_send(dst, sum(t.numel() * t.element_size() for t in tensors), tag)
        return self._enqueue(f"send to rank {dst}", self._inner.send(tensors, dst, tag),
                             p2p=True)

    def recv(self, tensors, src: int, tag: int = 0):
        self._usable("recv")
        self._connect(("pair", src))
        check = self._receive_check(src, sum(t.numel() * t.element_size() for t in tensors),
                                    tag)
        return self._enqueue(f"recv from rank {src}", self._inner.recv(tensors, src, tag),
                             check=check, p2p=True)

    # -- teardown -----------------------------------------------------------------------------
    def abort(self, reason: str = "the communicator was aborted (ncclCommAbort)") -> None:
        if self.aborted is None:
            self.aborted = reason

    def shutdown(self) -> None:
        self.abort("the communicator was shut down")


__all__ = ["OrderMismatch", "SETUP", "SimNcclError", "SimProcessGroup", "SimWork",
           "error_handling", "synchronize"]
