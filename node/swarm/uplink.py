"""The order in which bodies take this node's link (``Uplink``), so that the bytes the swarm's agreement rests
on are never stuck behind bulk.

A node's peers share its link, and every body it writes to any of them waits behind what it wrote before: in
the kernel's socket buffers, and in p2pd's. At 1 Mbit/s the sockets of one node held 0.1-1 MB (1-8 s of
the link) whenever snapshots or a round's contributions were on their way. A merge record written behind
them reached its peers seconds late, they elected from heads that had moved on, and two nodes merged the
same round: forks, and snapshots to mend them, which filled the link again (docs/chaos.md).

So a node keeps the bytes it has written and not yet seen arrive under a window of about ``TARGET_S`` of
its link (``MIN_WINDOW`` at least), and makes the rest wait here, where they can be put in order. Bodies
go by class: merge records, pings and evidence first, never waiting (``URGENT``, and any body of at most
``SMALL`` bytes); then contributions, then the records a catching-up member asked for, then snapshots, then
the messages an auditor asked for. A body that does not fit waits for the bodies ahead of it to arrive, and
one body always goes alone, however large (records and pings beside it).

A body has arrived when word of it comes back: for a call, the reply's header (the far end read it all);
for a reply this node serves, the caller closing the stream (it does once it has read the reply). The rate
the window follows is measured the same way, from what arrives: the bytes of bodies that arrived over the
last ``SPAN_S`` of time with bytes in flight (a burst of replies read at once must not pass for a fast
link), the fastest such measure of the last ``RATE_MEMORY_S`` (a link the node does not fill measures low,
and must not shrink the window); before any, the floor (``LinkRates.floor_bps``). A rate measured where the
bodies are read was no measure: a body that sat in a socket before it was read arrives at memory speed, and
a window sized from it held nothing back (the sockets of a node at 1 Mbit/s still held 0.5-1 MB).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

URGENT, CONTRIBUTION, RECORDS, SNAPSHOT, AUDIT = range(5)
NAMES = ("urgent", "contribution", "records", "snapshot", "audit")
CLASS_OF = {"contribute": CONTRIBUTION, "records": RECORDS, "snapshot": SNAPSHOT, "kept": AUDIT}
SMALL = 4 << 10  # bytes: a body this small never waits (headers, pings, requests for state)
MIN_WINDOW = 64 << 10  # bytes in flight allowed at the least (1 Mbit/s: half a second)
TARGET_S = 0.5  # seconds of the link the bytes in flight may take
RATE_MEMORY_S = 10.0  # seconds a rate measured stays the window's measure
SPAN_S = 1.0  # seconds with bytes in flight that one measure of the rate spans, at the least


def class_of(op: str, nbytes: int) -> int:
    """The class of a body of ``nbytes`` for ``op``: ops not named (records pushed, pings, evidence) are
    urgent, as is any small body."""
    return URGENT if nbytes <= SMALL else CLASS_OF.get(op, URGENT)


@dataclass
class Ticket:
    """A body taken onto the link: its bytes."""

    nbytes: int
    bulk: bool = False  # of a class that waits


class Uplink:
    """This node's bytes in flight (``out``) and the bodies waiting for room; ``floor_bps``: the rate counted
    on before one is measured (``LinkRates.floor_bps``); ``clock``: seconds, the loop's by default."""

    def __init__(self, floor_bps: float, clock: Callable[[], float] | None = None) -> None:
        self.floor_bps = floor_bps
        self.clock = clock
        self.out = 0
        self.out_bulk = 0  # of ``out``: bytes of bodies of the classes that wait
        self.delivered = 0  # bytes of bodies arrived, in all
        self._busy = 0.0  # seconds with bytes in flight, in all, up to ``_busy_since``
        self._busy_since = 0.0
        # (when, bytes arrived, seconds busy) at each arrival of the last SPAN_S busy seconds and more
        self._marks: deque[tuple[float, int, float]] = deque()
        self._rates: deque[tuple[float, float]] = deque()  # (when, bytes/s) measured, the newest last
        self._waiting: list[tuple[int, int, int, asyncio.Future]] = []  # (class, seq, bytes, granted)
        self._seq = itertools.count()
        self.waited_s = [0.0] * len(NAMES)  # per class: seconds bodies waited here, for status
        self.gave_up = [0] * len(NAMES)  # per class: bodies that waited past their caller's patience

    def _now(self) -> float:
        return self.clock() if self.clock is not None else asyncio.get_running_loop().time()

    def _busy_s(self, now: float) -> float:
        return self._busy + (now - self._busy_since if self.out > 0 else 0.0)

    def rate(self) -> float:
        """Bytes a second this node's link carries: the fastest measured in the last ``RATE_MEMORY_S``."""
        now = self._now()
        while self._rates and self._rates[0][0] < now - RATE_MEMORY_S:
            self._rates.popleft()
        return max((r for _, r in self._rates), default=self.floor_bps)

    def window(self) -> int:
        return max(MIN_WINDOW, int(TARGET_S * self.rate()))

    def _fits(self, nbytes: int) -> bool:
        """Room for a body that waits: within the window, or alone among such bodies (urgent ones do not
        count there: a trickle of records must not keep a body larger than the window waiting for ever)."""
        return self.out_bulk == 0 or self.out + nbytes <= self.window()

    def _ticket(self, nbytes: int, bulk: bool) -> Ticket:
        if self.out == 0:
            self._busy_since = self._now()
        self.out += nbytes
        self.out_bulk += nbytes if bulk else 0
        return Ticket(nbytes, bulk)

    async def take(self, nbytes: int, klass: int, wait_s: float) -> Ticket:
        """Room for a body of ``nbytes`` of ``klass`` on the link: at once for an urgent one, or when it
        fits and nothing ahead of it waits; else after the bodies ahead of it arrive. Raises
        ``TimeoutError`` after ``wait_s`` without room (nothing is then held). ``give`` the ticket back
        when the body has arrived, or failed."""
        if klass == URGENT:
            return self._ticket(nbytes, False)
        if not self._waiting and self._fits(nbytes):
            return self._ticket(nbytes, True)
        loop = asyncio.get_running_loop()
        granted: asyncio.Future = loop.create_future()
        heapq.heappush(self._waiting, (klass, next(self._seq), nbytes, granted))
        began = loop.time()
        try:
            async with asyncio.timeout(max(0.0, wait_s)):
                return await asyncio.shield(granted)
        except BaseException as e:
            if granted.done() and not granted.cancelled():
                self.give(granted.result(), arrived=False)  # room came as the wait ran out: handed on
            else:
                granted.cancel()  # left in the heap, skipped when reached
            if isinstance(e, TimeoutError):
                self.gave_up[klass] += 1
            raise
        finally:
            self.waited_s[klass] += loop.time() - began

    def give(self, ticket: Ticket, arrived: bool = True) -> None:
        """A body taken here has arrived (``arrived``: its rate is measured) or failed: room for the next."""
        now = self._now()
        busy = self._busy_s(now)
        self.out = max(0, self.out - ticket.nbytes)
        if ticket.bulk:
            self.out_bulk = max(0, self.out_bulk - ticket.nbytes)
        if self.out == 0:
            self._busy = busy
        if arrived:
            self.delivered += ticket.nbytes
            self._measure(now, busy)
        while self._waiting:
            klass, _, n, granted = self._waiting[0]
            if granted.done():  # its waiter gave up
                heapq.heappop(self._waiting)
                continue
            if not self._fits(n):
                break
            heapq.heappop(self._waiting)
            granted.set_result(self._ticket(n, True))

    def _measure(self, now: float, busy: float) -> None:
        """One measure of the rate, over the newest ``SPAN_S`` busy seconds or more, if there are as many."""
        marks = self._marks
        marks.append((now, self.delivered, busy))
        base = None
        while marks and busy - marks[0][2] >= SPAN_S:
            base = marks.popleft()
        if base is not None:
            marks.appendleft(base)  # the newest mark a span back: the next measure starts from it
            self._rates.append((now, (self.delivered - base[1]) / (busy - base[2])))

    def snapshot(self) -> dict:
        """For status: the bytes in flight, the window and the rate it follows, the bodies waiting, and what
        each class waited."""
        return {
            "out": self.out,
            "window": self.window(),
            "rate_bps": round(self.rate(), 1),
            "waiting": sum(1 for *_, g in self._waiting if not g.done()),
            "waited_s": {n: round(s, 3) for n, s in zip(NAMES, self.waited_s) if s},
            "gave_up": {n: k for n, k in zip(NAMES, self.gave_up) if k},
        }
