"""The replay's SSD server (planner/desim.Ssd): the engine's order (reads before queued writes),
its in-flight blocks, read-after-write, and the idle round trip."""

from __future__ import annotations

import pytest

from offloadpp.planner.desim import Done, Ssd, done_by, when
from offloadpp.planner.desim_loop import run

MB = 1_000_000


def drain(ssd: Ssd) -> None:
    ssd.advance(float("inf"))


def test_fifo_when_alone():
    ssd = Ssd(read_bps=100 * MB, write_bps=50 * MB, latency_s=0.001, inflight_bytes=0)
    w = ssd.submit(0.0, 50 * MB, write=True, key="a")
    r = ssd.submit(0.0, 100 * MB, write=False, key="b")
    assert ssd.busy and w.t is None
    drain(ssd)
    # the write found the device idle (round trip); the read, queued while the write was served,
    # takes the next block slot, and with no block in flight (inflight_bytes=0) it goes first
    assert r.t == pytest.approx(0.001 + 1.0)
    assert w.t == pytest.approx(0.001 + 1.0 + 1.0)
    assert ssd.read_bytes == 100 * MB and ssd.write_bytes == 50 * MB
    assert ssd.by_key == {"a": 50 * MB, "b": 100 * MB}
    assert not ssd.busy


def test_read_waits_for_the_writes_blocks_in_flight_only():
    ssd = Ssd(read_bps=100 * MB, write_bps=100 * MB, inflight_bytes=10 * MB)
    w1 = ssd.submit(0.0, 100 * MB, write=True)  # 1.0 s alone
    w2 = ssd.submit(0.0, 100 * MB, write=True)
    ssd.advance(0.5)
    r = ssd.submit(0.5, 50 * MB, write=False)
    drain(ssd)
    # the read starts after the 10 MB in flight (0.1 s), takes 0.5 s; both writes move back by 0.5 s
    assert r.t == pytest.approx(1.1)
    assert w1.t == pytest.approx(1.5)
    assert w2.t == pytest.approx(2.5)


def test_writes_keep_their_order_and_reads_theirs():
    ssd = Ssd(read_bps=100 * MB, write_bps=100 * MB, inflight_bytes=10 * MB)
    ws = [ssd.submit(0.0, 10 * MB, write=True) for _ in range(3)]
    rs = [ssd.submit(0.0, 10 * MB, write=False) for _ in range(3)]
    drain(ssd)
    order = sorted(ws + rs, key=lambda d: d.t)
    assert order == [ws[0], *rs, ws[1], ws[2]]  # the first write was wholly in flight when the reads came


def test_read_after_write_is_queued_when_the_write_is_done():
    ssd = Ssd(read_bps=100 * MB, write_bps=100 * MB, inflight_bytes=0)
    w = ssd.submit(0.0, 100 * MB, write=True, key="k")
    other = ssd.submit(0.0, 100 * MB, write=True, key="j")
    r = ssd.submit(0.1, 10 * MB, write=False, key="k", after=w)
    assert r.t is None and len(ssd.held) == 1
    drain(ssd)
    # held until its write is done (1.0 s), then first in line before the queued write of "j"
    assert w.t == pytest.approx(1.0)
    assert r.t == pytest.approx(1.1)
    assert other.t == pytest.approx(2.1)


def test_idle_device_pays_the_round_trip_once_per_busy_period():
    ssd = Ssd(read_bps=100 * MB, write_bps=100 * MB, latency_s=0.01, inflight_bytes=0)
    a = ssd.submit(0.0, 10 * MB, write=False)
    b = ssd.submit(0.0, 10 * MB, write=False)
    ssd.advance(1.0)
    c = ssd.submit(1.0, 10 * MB, write=False)
    drain(ssd)
    assert a.t == pytest.approx(0.11)
    assert b.t == pytest.approx(0.21)
    assert c.t == pytest.approx(1.11)
    assert ssd.busy_s == pytest.approx(0.21 + 0.11)


def test_when_and_done_by():
    d = Done()
    assert when(None) == 0.0 and when(2.0) == 2.0 and when(d) == float("inf")
    assert not done_by((1.0, d), 5.0)
    d.t = 3.0
    assert done_by((1.0, d, None), 3.0) and not done_by((d,), 2.9)


def test_a_replayed_slot_frees_after_every_release_s_after():
    """runtime/slots.py keeps the `after` of each release while another hold keeps the buffer;
    the replay's slot does too, so a copy still reading it (a refresh, a pump's copy) holds the
    memory until it is done whichever hold goes last (was: dropped, the buffer freed early)."""
    from offloadpp.planner.desim import Pool
    from offloadpp.planner.simulate_units import NEXT, OPTIM, READY, Slot

    pool = Pool(budget=1 << 20)
    s = Slot(
        key="u.master",
        nbytes=4096,
        pool=pool,
        resident=False,
        on_disk=False,
        state=READY,
        holds={OPTIM, NEXT},
    )
    s.release(None, OPTIM, after=5.0)  # the refresh's copy reads the buffer until t=5
    assert not pool.pending
    s.release(None, NEXT)
    ((n, ready),) = pool.pending
    assert n == 4096 and 5.0 in ready and not done_by(ready, 4.0)


class _Clock:
    """What run() reads of a replay: its clock, its SSD and two counters."""

    def __init__(self, ssd: Ssd):
        self.t, self.ssd, self.pool_wait_s, self.compute_busy_s = 0.0, ssd, 0.0, 0.0


def test_run_wakes_each_thread_at_its_event_while_the_ssd_serves_alone():
    """While no thread works and one waits for an SSD request not served yet, run() moves its
    clock through the SSD's completions (desim_loop._serve_idle): a thread waiting for SSD requests
    goes on at the completion of the last, one waiting for a time at that time, and a read
    submitted then still passes the queued write."""
    ssd = Ssd(read_bps=100 * MB, write_bps=100 * MB, inflight_bytes=0)
    sim = _Clock(ssd)
    seen: dict = {}

    def main():
        reads = [ssd.submit(sim.t, 10 * MB, write=False) for _ in range(3)]  # 0.1 s each
        w = ssd.submit(sim.t, 30 * MB, write=True)
        yield ("wait", (reads[-1],))
        seen["reads"] = sim.t
        yield ("wait", (w,))
        seen["write"] = sim.t

    def helper():
        yield ("until", 0.15)
        seen["until"] = sim.t
        yield ("until", 0.35)
        seen["read"] = ssd.submit(sim.t, 10 * MB, write=False)  # passes the write's blocks
        yield ("wait", (seen["read"],))
        seen["read at"] = sim.t

    run(sim, main(), [helper()], compute_slowdown=1.0, helper_slowdown=1.0)
    assert seen["until"] == 0.15 and seen["reads"] == pytest.approx(0.3)
    # the write ran 0.3-0.35, let the read pass (0.35-0.45), then the rest of its 0.3 s
    assert seen["read at"] == pytest.approx(0.45) and seen["write"] == pytest.approx(0.7)


def test_run_takes_at_most_two_helper_threads():
    """desim_loop.run holds each thread in locals (its Note): a third helper is refused by name,
    not dropped."""
    sim = _Clock(Ssd(read_bps=100 * MB, write_bps=100 * MB))

    def thread():
        yield ("until", 0.1)

    with pytest.raises(ValueError, match="at most two helper threads, got 3"):
        run(sim, thread(), [thread(), thread(), thread()], compute_slowdown=1.0, helper_slowdown=1.0)
    run(sim, thread(), [thread(), thread()], compute_slowdown=1.0, helper_slowdown=1.0)
    assert sim.t == 0.1
