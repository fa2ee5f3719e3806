"""The loop that runs the replay's threads (generators) on shared cores: desim.py's resources,
moved by one clock. Pure (no torch).

The requests a thread yields, the events the clock moves to and the CPU sharing are desim.py's
(its module Note). Threads: the main one (the device's compute) and up to two helpers (the
optimizer's worker, the activation mover).

Note: why the threads are unrolled. The loop runs once per event, thousands of times per replay
and over a hundred replays per plan searched; with the threads in a list it was a fifth of the
planning time. Each thread's state is three locals here (its generator's __next__, its request,
its work left), and each pass checks the main thread, then the helpers in their order, as the
loop over the list did: the same resumes in the same order, the same clock, bit for bit. A
missing helper is a thread that waits for no time ever (("until", inf)): never resumed, never
the next event, never computing.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from .desim import INF, Done, Replay, Ssd

_DONE = ("done",)
_NEVER = ("until", INF)  # (a missing helper's request)


def run(sim: Replay, main: Iterator, helpers: Sequence[Iterator], *, compute_slowdown: float,
        helper_slowdown: float, io_slowdown: float = 1.0) -> None:  # fmt: skip
    """Runs `main` and the `helpers` (at most two) together until `main` is done."""
    if len(helpers) > 2:
        raise ValueError(f"the replay runs at most two helper threads, got {len(helpers)}")
    ssd = sim.ssd
    m_next = main.__next__
    m_req, m_work = _first(m_next)
    a_next = b_next = None
    a_req = b_req = _NEVER
    a_work = b_work = 0.0
    if helpers:
        a_next = helpers[0].__next__
        a_req, a_work = _first(a_next)
    if len(helpers) > 1:
        b_next = helpers[1].__next__
        b_req, b_work = _first(b_next)
    guard = 0
    ssd_paces = io_slowdown != 1.0
    flat = compute_slowdown == 1.0 and helper_slowdown == 1.0 and io_slowdown == 1.0
    # (the replay's hottest loop: branches and locals here, not helper calls; a thread is
    # resumed inline, and the helpers computing are counted by the pass that resumes)
    while m_req is not _DONE:
        guard += 1
        if guard > 10_000_000:
            raise RuntimeError("cost model replay did not finish (internal error)")
        t = sim.t
        if ssd.cur is not None and ssd.cur_end <= t:
            ssd.advance(t)
        progressed = others = False
        busy_helpers = 0  # (of the helpers not resumed: counted for the rates below)

        # -- requests that are already satisfied resume at once: the main thread, then the helpers
        req = m_req
        kind = req[0]
        go = False
        if kind == "cpu":
            if m_work <= 1e-12:
                go = True
        elif kind == "wait":
            go = True
            for x in req[1]:  # (done_by, inline)
                if x is None:
                    continue
                if x.__class__ is Done:
                    x = x.t
                    if x is None:
                        go = False
                        break
                if x > t:
                    go = False
                    break
        elif kind == "until":
            if req[1] <= t:
                go = True
        elif kind == "cond":
            if req[1]():
                go = True
        elif kind == "idle":
            if req[1].queue or req[2].closed:
                go = True
        if go:
            try:
                req = m_next()
            except StopIteration:
                m_req, m_work = _DONE, 0.0
            else:
                m_req = req
                m_work = req[1] if req[0] == "cpu" else 0.0
            progressed = True

        req = a_req
        kind = req[0]
        go = False
        if kind == "cpu":
            if a_work > 1e-12:
                busy_helpers += 1
            else:
                go = True
        elif kind == "idle":
            if req[1].queue or req[2].closed:
                go = True
        elif kind == "until":
            if req[1] <= t:
                go = True
        elif kind == "wait":
            go = True
            for x in req[1]:  # (done_by, inline)
                if x is None:
                    continue
                if x.__class__ is Done:
                    x = x.t
                    if x is None:
                        go = False
                        break
                if x > t:
                    go = False
                    break
        elif kind == "cond":
            if req[1]():
                go = True
        if go:
            try:
                req = a_next()
            except StopIteration:
                a_req, a_work = _DONE, 0.0
            else:
                a_req = req
                a_work = req[1] if req[0] == "cpu" else 0.0
            progressed = others = True

        req = b_req
        kind = req[0]
        go = False
        if kind == "cpu":
            if b_work > 1e-12:
                busy_helpers += 1
            else:
                go = True
        elif kind == "idle":
            if req[1].queue or req[2].closed:
                go = True
        elif kind == "until":
            if req[1] <= t:
                go = True
        elif kind == "wait":
            go = True
            for x in req[1]:  # (done_by, inline)
                if x is None:
                    continue
                if x.__class__ is Done:
                    x = x.t
                    if x is None:
                        go = False
                        break
                if x > t:
                    go = False
                    break
        elif kind == "cond":
            if req[1]():
                go = True
        if go:
            try:
                req = b_next()
            except StopIteration:
                b_req, b_work = _DONE, 0.0
            else:
                b_req = req
                b_work = req[1] if req[0] == "cpu" else 0.0
            progressed = others = True

        if progressed:
            # (another pass, unless only the main thread resumed, the helpers checked after it,
            # and its new request waits for the clock: work, or a time to come. Then that pass
            # would resume nothing, as no SSD request ends by now either)
            if others or (ssd.cur is not None and ssd.cur_end <= t):
                continue
            if m_req[0] == "cpu":
                if m_work <= 1e-12:
                    continue
            elif m_req[0] != "until" or m_req[1] <= t:
                continue

        # -- the next event: the first thread's work done, a time waited for, or an SSD request
        computing = m_req[0] == "cpu"
        if flat:  # (the rates below where every slowdown is 1: a GPU's replay)
            main_rate = 1.0
            helper_rate = 1.0 / busy_helpers if computing and busy_helpers > 1 else 1.0
        else:
            main_rate = (1.0 / compute_slowdown if computing and busy_helpers else 1.0) / (
                io_slowdown if ssd.cur is not None else 1.0
            )
            helper_rate = 1.0 / (helper_slowdown * busy_helpers) if computing and busy_helpers else 1.0
        nxt = INF
        first_done = 0  # whose work ends first: 1 main, 2 and 3 the helpers, 0 none
        served = False  # a thread waits for an SSD request not served yet
        kind = m_req[0]
        if kind == "cpu":
            end = t + m_work / main_rate
            if end < nxt:
                nxt, first_done = end, 1
        elif kind == "until":
            nxt = m_req[1]
        elif kind == "wait":
            nxt = _last(m_req[1])
            if nxt == INF:
                served = True
        kind = a_req[0]
        if kind == "cpu":
            end = t + a_work / helper_rate
            if end < nxt:
                nxt, first_done = end, 2
        elif kind == "until":
            if a_req[1] < nxt:
                nxt, first_done = a_req[1], 0
        elif kind == "wait":
            last = _last(a_req[1])
            if last < nxt:
                nxt, first_done = last, 0
            elif last == INF:
                served = True
        kind = b_req[0]
        if kind == "cpu":
            end = t + b_work / helper_rate
            if end < nxt:
                nxt, first_done = end, 3
        elif kind == "until":
            if b_req[1] < nxt:
                nxt, first_done = b_req[1], 0
        elif kind == "wait":
            last = _last(b_req[1])
            if last < nxt:
                nxt, first_done = last, 0
            elif last == INF:
                served = True
        if ssd.cur is not None and ssd.cur_end <= nxt and (served or ssd_paces or nxt == INF):
            # (the end of an SSD request is an event of its own only where a thread may wait for
            # it, or where the SSD's work slows compute: see desim's Note on events)
            if served and not computing and not busy_helpers:
                _serve_idle(ssd, sim, (m_req, a_req, b_req), nxt)
                continue
            nxt, first_done = ssd.cur_end, 0
        if nxt == INF:
            waits = ", ".join(q[0] for q in (m_req, a_req, b_req)[: 1 + len(helpers)])
            raise RuntimeError(f"cost model replay deadlocked (internal error): threads wait on {waits}")
        dt = nxt - t
        if computing:
            left = m_work - dt * main_rate
            m_work = left if left > 0.0 else 0.0
        if busy_helpers:  # (every helper whose request is work: counted by the pass)
            if a_req[0] == "cpu":
                left = a_work - dt * helper_rate
                a_work = left if left > 0.0 else 0.0
            if b_req[0] == "cpu":
                left = b_work - dt * helper_rate
                b_work = left if left > 0.0 else 0.0
        # (exactly done, whatever the rounding of t + work / rate)
        if first_done == 1:
            m_work = 0.0
        elif first_done == 2:
            a_work = 0.0
        elif first_done == 3:
            b_work = 0.0
        if computing:
            sim.compute_busy_s += dt
        sim.t = nxt


def _last(items) -> float:
    """The latest of the items' `when` (desim.when): inf while an SSD request is not served."""
    last = 0.0
    for x in items:
        if x is None:
            continue
        if x.__class__ is Done:
            x = x.t
            if x is None:
                return INF
        if x > last:
            last = x
    return last


def _first(resume) -> tuple:
    """A thread's first request and its work (run's state of a thread)."""
    try:
        req = resume()
    except StopIteration:
        return _DONE, 0.0
    return req, (req[1] if req[0] == "cpu" else 0.0)


def _serve_idle(ssd: Ssd, sim: Replay, reqs: tuple, until: float) -> None:
    """run's clock through the SSD's completions while no thread works and one waits for an SSD
    request not served yet, up to the first completion that serves every request some thread
    waits for, or the next event of another kind (`until`: the earliest "until" time).

    Note: why this is the loop's own passes, fewer. In each of those passes the clock moved to
    the SSD's next completion and the next pass served it and resumed nothing: no thread works
    (no work to advance, no busy time to count), a "cond" or an idle thread reads only what the
    threads set (none runs), an "until" time is not reached, and a thread waiting for SSD
    requests goes on only once all are served. The first pass that may resume a thread is
    left to the loop, at the same clock, with the SSD in the same state."""
    waits = [q[1] for q in reqs if q[0] == "wait"]
    while True:
        sim.t = t = ssd.cur_end
        ssd.advance(t)
        for items in waits:
            for x in items:
                if x.__class__ is Done and x.t is None:
                    break
            else:  # (every request this thread waits for is served: the loop's pass decides)
                return
        if ssd.cur is None or ssd.cur_end > until:
            return


__all__ = ["run"]
