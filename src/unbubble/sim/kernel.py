"""The engine's fast path: ``_run_reference``'s semantics on flat arrays, compiled with numba.

For one-stage ranks driven by ``ListPolicy`` or ``PaciPolicy`` the kernel makes the reference's decisions
at the same times in the same order (checked row for row by ``tests/unit/test_sim_kernel.py``). Why numba:
the loop is sequential, so it does not vectorise, and in CPython the interpreter itself is the cost.
Without numba, or with ``UNBUBBLE_SIM_NUMBA=0``, ``run`` returns ``None`` and the engine runs the reference.

Notes: [Note: compiled engine] in docs/architecture.md#simkernelpy.
"""

from __future__ import annotations

import os

import numpy as np

from unbubble.schedules.policy import PaciPolicy, StageState
from unbubble.sim.costs import KIND_INDEX, _Sampler

_F, _B, _I, _W, _U = 0, 1, 2, 3, 4


def _push(ht, hq, hs, hn, t, q, s):
    """Pushes wake-up (t, q, s) onto the heap of size ``hn`` (arrays large enough); returns hn + 1."""
    i = hn
    while i > 0:
        p = (i - 1) >> 1
        if ht[p] < t or (ht[p] == t and hq[p] < q):
            break
        ht[i], hq[i], hs[i] = ht[p], hq[p], hs[p]
        i = p
    ht[i], hq[i], hs[i] = t, q, s
    return hn + 1


def _pop(ht, hq, hs, hn):
    """Removes the root of the heap of size ``hn`` (> 0), moving the last entry down; returns hn − 1."""
    hn -= 1
    t, q, s = ht[hn], hq[hn], hs[hn]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= hn:
            break
        if c + 1 < hn and (ht[c + 1] < ht[c] or (ht[c + 1] == ht[c] and hq[c + 1] < hq[c])):
            c += 1
        if ht[c] < t or (ht[c] == t and hq[c] < q):
            ht[i], hq[i], hs[i] = ht[c], hq[c], hs[c]
            i = c
        else:
            break
    ht[i], hq[i], hs[i] = t, q, s
    return hn


def _kernel(n, total, is_paci, acc, cap, prog_kind, prog_mb, prog_off, table, has_fac, fac, fac_off,
            st_stage, st_slow, st_start, st_end, has_noise, fdelay, bdelay, stashed, max_rows, mb_cap,
            fq_off, bq_off):
    """One run; see [Note: compiled engine]. Arrays are int64 / float64, ``table`` is (n, 5) seconds.

    Returns ``(nr, ri, rf, state, fwd_ready, bwd_ready)``: the number of rows; their integer columns
    ``ri`` (stage, kind, mb, version, weights version) and times ``rf`` (start_s, end_s), valid up to
    ``nr``; the final per-stage ``state`` rows (in_flight, bwd_since_update, version, n_fwd, n_bwd,
    n_actions); the ready sets as ``(n, mb_cap)`` bitmaps.
    """
    ri = np.empty((5, max_rows), np.int64)  # rows: stage, kind, mb, version, weights version
    rf = np.empty((2, max_rows), np.float64)  # rows: start_s, end_s
    nr = 0
    state = np.zeros((6, n), np.int64)
    in_flight, bsu, version, n_fwd, n_bwd, n_act = state[0], state[1], state[2], state[3], state[4], state[5]
    used = np.zeros(n * 5, np.int64)
    fr = np.zeros((n, mb_cap), np.uint8)
    br = np.zeros((n, mb_cap), np.uint8)
    br_cnt = np.zeros(n, np.int64)
    br_lo = np.zeros(n, np.int64)  # no mb below it is in br (a lower bound of min(br))
    fv = np.zeros((n, mb_cap), np.int32) if stashed else np.zeros((1, 1), np.int32)  # v_F per (stage, mb)
    busy = np.zeros(n, np.float64)
    # message queues of stage s: slots fq_off[s] .. fq_off[s + 1], head and tail counted from fq_off[s]
    fq_t = np.empty(fq_off[n], np.float64)
    fq_mb = np.empty(fq_off[n], np.int64)
    bq_t = np.empty(bq_off[n], np.float64)
    bq_mb = np.empty(bq_off[n], np.int64)
    fq_h = np.zeros(n, np.int64)
    fq_n = np.zeros(n, np.int64)
    bq_h = np.zeros(n, np.int64)
    bq_n = np.zeros(n, np.int64)
    hcap = 4 * n + 16
    ht = np.empty(hcap, np.float64)
    hq = np.empty(hcap, np.int64)
    hs = np.empty(hcap, np.int64)
    hn = 0
    seq = 0
    for s in range(n):
        hn = _push(ht, hq, hs, hn, 0.0, seq, s)
        seq += 1
    last = n - 1
    n_st = st_stage.shape[0]

    while hn > 0:
        t = ht[0]
        s = hs[0]
        hn = _pop(ht, hq, hs, hn)
        while True:
            if t < busy[s]:
                break
            # deliver the messages that have arrived
            base = fq_off[s]
            while fq_h[s] < fq_n[s] and fq_t[base + fq_h[s]] <= t:
                fr[s, fq_mb[base + fq_h[s]]] = 1
                fq_h[s] += 1
            base = bq_off[s]
            while bq_h[s] < bq_n[s] and bq_t[base + bq_h[s]] <= t:
                mb = bq_mb[base + bq_h[s]]
                if br[s, mb] == 0:
                    br[s, mb] = 1
                    br_cnt[s] += 1
                    if mb < br_lo[s]:
                        br_lo[s] = mb
                bq_h[s] += 1
            # decide (PaciPolicy.next_action with its a and cap / ListPolicy.next_action)
            if is_paci[s]:
                if bsu[s] >= acc[s]:
                    k = _U
                    mb = -1
                elif br_cnt[s] > 0:
                    mb = br_lo[s]
                    while br[s, mb] == 0:
                        mb += 1
                    br_lo[s] = mb
                    k = _B
                else:
                    mb = n_fwd[s]
                    if mb < total and in_flight[s] < cap[s] and (s == 0 or fr[s, mb] != 0):
                        k = _F
                    else:
                        break
            else:
                i = prog_off[s] + n_act[s]
                if i >= prog_off[s + 1]:
                    break
                k = prog_kind[i]
                mb = prog_mb[i]
                if k == _F:
                    if s == 0:
                        if not mb < total:
                            break
                    elif fr[s, mb] == 0:
                        break
                elif k == _B or k == _I:
                    if br[s, mb] == 0:
                        break
            # duration (the sampler's arithmetic: table × jitter factor × straggler slowdowns)
            d = table[s, k]
            if has_noise:
                if has_fac:
                    j = s * 5 + k
                    d *= fac[fac_off[j] + used[j]]
                    used[j] += 1
                for x in range(n_st):
                    if st_stage[x] == s and st_start[x] <= t and t < st_end[x]:
                        d *= st_slow[x]
            end = t + d
            v = version[s]
            w = v
            if stashed:
                if k == _F:
                    fv[s, mb] = v
                elif k != _U:
                    w = fv[s, mb]
            ri[0, nr], ri[1, nr], ri[2, nr], ri[3, nr], ri[4, nr] = s, k, mb, v, w
            rf[0, nr], rf[1, nr] = t, end
            nr += 1
            busy[s] = end
            n_act[s] += 1
            # own wake-up (created before the message's); taken at once when it is the next event
            again = hn == 0 or ht[0] > end
            if hn + 2 > hcap:
                hcap *= 2
                ht2 = np.empty(hcap, np.float64)
                hq2 = np.empty(hcap, np.int64)
                hs2 = np.empty(hcap, np.int64)
                ht2[:hn] = ht[:hn]
                hq2[:hn] = hq[:hn]
                hs2[:hn] = hs[:hn]
                ht, hq, hs = ht2, hq2, hs2
            if not again:
                hn = _push(ht, hq, hs, hn, end, seq, s)
                seq += 1
            if k == _F:
                fr[s, mb] = 0
                in_flight[s] += 1
                n_fwd[s] += 1
                if s == last:
                    if br[s, mb] == 0:
                        br[s, mb] = 1
                        br_cnt[s] += 1
                        if mb < br_lo[s]:
                            br_lo[s] = mb
                else:
                    arrival = end + fdelay[s]
                    fq_t[fq_off[s + 1] + fq_n[s + 1]] = arrival
                    fq_mb[fq_off[s + 1] + fq_n[s + 1]] = mb
                    fq_n[s + 1] += 1
                    if arrival >= busy[s + 1]:
                        hn = _push(ht, hq, hs, hn, arrival, seq, s + 1)
                        seq += 1
            elif k == _B or k == _I:
                if br[s, mb] != 0:
                    br[s, mb] = 0
                    br_cnt[s] -= 1
                in_flight[s] -= 1
                n_bwd[s] += 1
                bsu[s] += 1
                if s > 0:
                    arrival = end + bdelay[s]
                    bq_t[bq_off[s - 1] + bq_n[s - 1]] = arrival
                    bq_mb[bq_off[s - 1] + bq_n[s - 1]] = mb
                    bq_n[s - 1] += 1
                    if arrival >= busy[s - 1]:
                        hn = _push(ht, hq, hs, hn, arrival, seq, s - 1)
                        seq += 1
            elif k == _U:
                version[s] += 1
                bsu[s] = 0
            if not again:
                break
            t = end
    return nr, ri, rf, state, fr, br


_COMPILED = None  # the jitted kernel once built; False when numba is missing


def compiled():
    """The numba-compiled kernel, built on first use.

    Returns:
        The jitted ``_kernel``, or ``None`` when numba is not installed (install the ``fast``
        extra) or the environment sets ``UNBUBBLE_SIM_NUMBA=0`` (read at every call).
    """
    global _COMPILED, _push, _pop
    if os.environ.get("UNBUBBLE_SIM_NUMBA", "1") == "0":
        return None
    if _COMPILED is None:
        try:
            import numba
        except ImportError:
            _COMPILED = False
        else:
            jit = numba.njit(cache=True, nogil=True)
            _push, _pop = jit(_push), jit(_pop)  # the kernel calls these module globals
            _COMPILED = jit(_kernel)
    return _COMPILED or None


def _program(pol) -> tuple[list[int], list[int]]:
    """A ``ListPolicy``'s actions as (kind indices, mbs with −1 for U)."""
    kidx = KIND_INDEX
    acts = pol.actions
    return [kidx[a.kind] for a in acts], [-1 if a.mb is None else a.mb for a in acts]


def action_counts(total: int, pols, lists: list[list[int] | None]) -> np.ndarray:
    """Actions of each kind per stage, ``(n, 5)`` in ``KIND_INDEX`` order: a ``ListPolicy``'s kind
    indices counted from ``lists[s]``, a ``PaciPolicy`` (``lists[s] is None``) bounded from above by
    ``total`` F and B and ``total // a`` U (a run that deadlocks does fewer)."""
    counts = np.zeros((len(pols), 5), np.int64)
    for s, (p, k) in enumerate(zip(pols, lists)):
        if k is None:
            counts[s, _F] = counts[s, _B] = total
            counts[s, _U] = total // p.a if p.a > 0 else 0
        elif k:
            counts[s] = np.bincount(np.asarray(k, np.int64), minlength=5)[:5]
    return counts


def prepare(n, total, pols, is_paci, table, noise, fdelay, bdelay, stashed):
    """The kernel's arguments for one run ([Note: compiled engine]).

    Args:
        n: stages (one per rank). total: micro-batches of the run.
        pols: per-stage ``ListPolicy`` or ``PaciPolicy``; ``is_paci[s]`` tells which.
        table: ``(n, 5)`` mean durations in seconds, kinds in ``KIND_INDEX`` order.
        noise: ``None`` or a fresh sampler from ``PipelineCosts.noise``.
        fdelay, bdelay: per-stage send latency (s) of activations to s + 1 and gradients to s − 1.
        stashed: backwards use their forward's weight version.

    Returns:
        The positional arguments of ``_kernel``, or ``None`` when ``noise`` is some other callable
        (its draws cannot be taken ahead; the engine then runs the reference).
    """
    if noise is not None and not isinstance(noise, _Sampler):
        return None
    kinds: list[int] = []
    mbs: list[int] = []
    off = [0]
    acc = np.zeros(n, np.int64)
    cap = np.zeros(n, np.int64)
    max_mb = total - 1
    lists: list[list[int] | None] = []
    for s, p in enumerate(pols):
        if is_paci[s]:
            acc[s], cap[s] = p.a, p.cap
            lists.append(None)
        else:
            k, m = _program(p)
            kinds += k
            mbs += m
            lists.append(k)
            if m:
                max_mb = max(max_mb, max(m))
        off.append(len(kinds))
    counts = action_counts(total, pols, lists)
    max_rows = int(counts.sum())
    # messages into stage s: forwards of s − 1 (activations) and backwards of s + 1 (gradients)
    f_in = np.zeros(n, np.int64)
    b_in = np.zeros(n, np.int64)
    f_in[1:] = counts[:-1, _F]
    b_in[:-1] = counts[1:, _B] + counts[1:, _I]
    fq_off = np.concatenate(([0], np.cumsum(f_in))).astype(np.int64)
    bq_off = np.concatenate(([0], np.cumsum(b_in))).astype(np.int64)
    fac = np.zeros(1, np.float64)
    fac_off = np.zeros(n * 5 + 1, np.int64)
    st = ([], [], [], [])
    has_fac = False
    if noise is not None:
        has_fac = bool(noise.sigma)
        if has_fac:
            fac, fac_off = noise.draws(counts)
        for x in noise.stragglers:
            for col, val in zip(st, (x.stage, x.slowdown, x.start_s, x.end_s)):
                col.append(val)
    return (n, total, np.asarray(is_paci, np.int64), acc, cap, np.asarray(kinds, np.int64), np.asarray(mbs, np.int64),
            np.asarray(off, np.int64), np.asarray(table, np.float64), has_fac, fac, fac_off,
            np.asarray(st[0], np.int64), np.asarray(st[1], np.float64), np.asarray(st[2], np.float64),
            np.asarray(st[3], np.float64), noise is not None, np.asarray(fdelay, np.float64),
            np.asarray(bdelay, np.float64), bool(stashed), max_rows, max_mb + 1, fq_off, bq_off)


def run(n, total, pols, table, noise, fdelay, bdelay, stashed):
    """One run on the compiled kernel ([Note: compiled engine]).

    Args:
        n: stages, one per rank. total: micro-batches of the run.
        pols: per-stage ``ListPolicy`` or ``PaciPolicy`` (exactly these classes).
        table: ``(n, 5)`` mean durations in seconds, kinds in ``KIND_INDEX`` order.
        noise: ``None`` or a fresh sampler from the cost model's ``noise(n)``.
        fdelay, bdelay: per-stage send latency (s) of activations to s + 1 and gradients to s − 1.
        stashed: backwards use their forward's weight version.

    Returns:
        ``(columns, states, stage_lists)``: the trace's seven :data:`~unbubble.sim.engine.Row`
        columns as numpy arrays, each stage's final :class:`StageState`, and each ``ListPolicy``'s
        action list (``None`` for PACI stages); or ``None`` when the kernel is off (no numba, or
        ``UNBUBBLE_SIM_NUMBA=0``) or ``noise`` is not the built-in sampler: the engine then runs the
        reference.
    """
    fn = compiled()
    if fn is None:
        return None
    is_paci = [type(p) is PaciPolicy for p in pols]
    args = prepare(n, total, pols, is_paci, table, noise, fdelay, bdelay, stashed)
    if args is None:
        return None
    nr, ri, rf, state, fr, br = fn(*args)
    cols = (ri[0, :nr], ri[1, :nr], ri[2, :nr], rf[0, :nr], rf[1, :nr], ri[3, :nr], ri[4, :nr])
    states = [StageState(s, n, total, fwd_ready=set(fr[s].nonzero()[0].tolist()),
                         bwd_ready=set(br[s].nonzero()[0].tolist()), in_flight=q, bwd_since_update=bsu,
                         version=v, n_fwd=nf, n_bwd=nb, n_actions=na)
              for s, (q, bsu, v, nf, nb, na) in enumerate(zip(*state.tolist()))]
    stage_lists = [None if is_paci[s] else pols[s].actions for s in range(n)]
    return cols, states, stage_lists
