"""Generators of synchronous (flushed) schedules as per-rank action lists.

Every generator returns ``order[rank]`` for ``steps`` optimizer steps of ``m`` micro-batches
each (global ids: step t covers ``t*m … t*m + m − 1``); every stage applies ``U`` after its
step's last backward, so every backward runs on the weights of its forward (Δ = 0).
"""

from __future__ import annotations

from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import StageState

F, B, I, W, U = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.U


def _repeat(one_step: list[list[Action]], m: int, steps: int) -> list[list[Action]]:
    """Repeats step 0's per-rank lists for ``steps`` steps, shifting micro-batch ids by m."""
    return [[Action(a.stage, a.kind, None if a.mb is None else a.mb + t * m) for t in range(steps) for a in acts]
            for acts in one_step]


def gpipe(n_stages: int, m: int, steps: int) -> list[list[Action]]:
    """GPipe: all m forwards, then all m backwards, then ``U`` (flush).

    Memory: m activations per stage. Bubble (N−1)/(m+N−1) of the step.
    Source: GPipe, arXiv 1811.06965, §2.2.
    """
    one = [[Action(s, F, k) for k in range(m)] + [Action(s, B, k) for k in range(m)] + [Action(s, U)]
           for s in range(n_stages)]
    return _repeat(one, m, steps)


def one_f_one_b_flush(n_stages: int, m: int, steps: int) -> list[list[Action]]:
    """1F1B with a flush after every m micro-batches (PipeDream-Flush / DAPPLE).

    Stage i (1-based) runs min(N − i, m) warm-up forwards, then alternates one forward
    and one backward, drains the remaining backwards, and applies ``U`` after the step's
    m backwards. At most N + 1 − i activations are held; bubble (N−1)/(m+N−1).

    Source: DAPPLE, arXiv 2007.01045, §3; PipeDream-2BW, arXiv 2006.09503, §3 (1F1B-flush).
    """
    one: list[list[Action]] = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, m)
        acts = [Action(s, F, j) for j in range(warmup)]
        for j in range(m - warmup):
            acts += [Action(s, F, warmup + j), Action(s, B, j)]
        acts += [Action(s, B, j) for j in range(m - warmup, m)] + [Action(s, U)]
        one.append(acts)
    return _repeat(one, m, steps)


def interleaved_1f1b(n_ranks: int, v: int, m: int, steps: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: rank r hosts the v virtual stages r, r + N, …, r + (v−1)N.

    Forwards visit chunks in groups of N micro-batches (chunk 0 for micro-batches 0…N−1,
    then chunk 1 for the same ones, …); backwards visit chunks in reverse. Rank r runs
    (N − r − 1)·2 + (v − 1)·N warm-up forwards, then 1F1B, then the remaining backwards,
    then ``U`` on each of its stages. Bubble (N−1)/(v·m + N − 1) of the step for F = B.

    Args:
        n_ranks: devices N (the pipeline has N·v stages).
        v: virtual stages (model chunks) per rank.
        m: micro-batches per step; must be a multiple of N.

    Source: Narayanan et al., arXiv 2104.04473, §2.2 (Megatron-LM interleaved schedule).
    """
    total = m * v

    def chunk_mb(j: int, backward: bool) -> tuple[int, int]:
        chunk = (j // n_ranks) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (j // (n_ranks * v)) * n_ranks + j % n_ranks

    one: list[list[Action]] = []
    for r in range(n_ranks):
        warmup = min((n_ranks - r - 1) * 2 + (v - 1) * n_ranks, total)
        acts: list[Action] = []

        def fwd(j: int) -> Action:
            c, k = chunk_mb(j, False)
            return Action(c * n_ranks + r, F, k)

        def bwd(j: int) -> Action:
            c, k = chunk_mb(j, True)
            return Action(c * n_ranks + r, B, k)

        acts += [fwd(j) for j in range(warmup)]
        for j in range(total - warmup):
            acts += [fwd(warmup + j), bwd(j)]
        acts += [bwd(j) for j in range(total - warmup, total)]
        acts += [Action(c * n_ranks + r, U) for c in range(v)]
        one.append(acts)
    return _repeat(one, m, steps)


def zb_h1(n_stages: int, m: int, steps: int) -> list[list[Action]]:
    """ZB-H1: the Zero Bubble paper's handcrafted schedule with 1F1B's activation memory.

    Backward is split into I (input gradient, on the critical path) and W (weight
    gradient). Stage r (0-based) runs min(N − r, m) warm-up forwards, then repeats
    [I; a W once more than r I's have run; F], drains the remaining W, then applies U
    (flush). Each stage holds at most N micro-batches' activations (released by W); at
    F = I = W the bubble is (N−1) per step, 1/3 of 1F1B's 3(N−1).

    Source: Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, §2.1 and Fig. 3 (top).
    """
    one = []
    for r in range(n_stages):
        warm = min(n_stages - r, m)
        acts = [Action(r, F, k) for k in range(warm)]
        f, i, w = warm, 0, 0
        while i < m:
            acts.append(Action(r, I, i))
            i += 1
            if i > r:
                acts.append(Action(r, W, w))
                w += 1
            if f < m:
                acts.append(Action(r, F, f))
                f += 1
        acts += [Action(r, W, j) for j in range(w, m)] + [Action(r, U)]
        one.append(acts)
    return _repeat(one, m, steps)


def zero_bubble(n_stages: int, m: int, steps: int, memory: int) -> list[list[Action]]:
    """ZB-H2-style schedule: backward split into I (input gradient) and W (weight gradient);
    W passes, off the critical path, fill what would be bubbles.

    Generated by list scheduling on unit costs F = I = W: each stage runs, in priority
    order, an I whose output gradient has arrived (the critical path), a forward while
    fewer than ``memory`` · N micro-batches hold activations (released by W), else a pending
    W; ``U`` after the step's last W (flush). ``memory=2`` (ZB-H2) holds up to 2N
    micro-batches' activations. Measured on the simulator at F = I = W
    (tests/unit/test_schedule_ir.py): the bubble is 1/6 of 1F1B-flush's; the paper's ZB-H2
    reaches ≈ 0 by also dropping the flush (optimizer post-validation, not done here).

    Source: Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, §3.1 (ZB-H1, ZB-H2).
    """
    n = n_stages
    cap = min(memory * n, m)  # micro-batches holding activations (released by W) on every stage
    states = [StageState(s, n, m) for s in range(n)]
    pending_w: list[list[int]] = [[] for _ in range(n)]
    held = [0] * n
    free_at = [0] * n
    inbox: list[list[tuple[int, ActionKind, int]]] = [[] for _ in range(n)]
    one: list[list[Action]] = [[] for _ in range(n)]
    t = 0
    while any(len(one[s]) < 3 * m for s in range(n)):
        progressed = False
        for s in range(n):
            if free_at[s] > t:
                continue
            st = states[s]
            for item in [x for x in inbox[s] if x[0] <= t]:
                (st.fwd_ready if item[1] is F else st.bwd_ready).add(item[2])
                inbox[s].remove(item)
            act = None
            if st.bwd_ready:
                act = Action(s, I, min(st.bwd_ready))
            elif st.n_fwd < m and held[s] < cap and st.input_ready(st.n_fwd):
                act = Action(s, F, st.n_fwd)
            elif pending_w[s]:
                act = Action(s, W, pending_w[s].pop(0))
            if act is None:
                continue
            progressed = True
            one[s].append(act)
            free_at[s] = t + 1
            if act.kind is F:
                held[s] += 1
                if s + 1 < n:
                    inbox[s + 1].append((t + 1, F, act.mb))
            elif act.kind is I:
                pending_w[s].append(act.mb)
                if s > 0:
                    inbox[s - 1].append((t + 1, B, act.mb))
            else:
                held[s] -= 1
            st.apply(act)
        t += 1
        if not progressed and t > 10 * (n + 3 * m):
            raise RuntimeError("zero-bubble generator made no progress")  # unreachable for valid N, m
    for s in range(n):
        one[s].append(Action(s, U))
    return _repeat(one, m, steps)
