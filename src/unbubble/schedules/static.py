"""Generators of synchronous (flushed) schedules as per-rank action lists.

Every generator returns ``order[rank]`` for ``steps`` optimizer steps of ``m`` micro-batches
each (global ids: step t covers ``t*m … t*m + m − 1``); every stage applies ``U`` after its
step's last backward, so every backward runs on the weights of its forward (Δ = 0).
"""

from __future__ import annotations

from unbubble.schedules.actions import Action, ActionKind, Overlap
from unbubble.schedules.policy import StageState

F, B, I, W, U = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.U


def _shift(a: Action, by: int) -> Action:
    return Action(a.stage, a.kind, None if a.mb is None else a.mb + by)


def _repeat(one_step: list[list], m: int, steps: int) -> list[list]:
    """Repeats step 0's per-rank lists for ``steps`` steps, shifting micro-batch ids by m
    (an :class:`Overlap` shifts both parts)."""
    return [[Overlap(_shift(a.first, t * m), _shift(a.second, t * m)) if isinstance(a, Overlap) else _shift(a, t * m)
             for t in range(steps) for a in acts]
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
    (tests/unit/test_schedule_ir.py), in units of one action: ZB-H1's bubble is (N−1) per step,
    1/3 of 1F1B-flush's; ZB-H2's first step has ZB-H1's, max(N−1, 2N−1−m), and each later step
    max(0, 2N−1−m), as a stage starts its next step while later stages finish (so 1/6 of 1F1B's
    over two steps at m ≥ 2N−1, ≈ 0 in steady state). The paper's ZB-H2 has ≈ 0 in every step by
    also dropping the flush (optimizer post-validation, not done here).

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


def looped_bfs(n_ranks: int, v: int, m: int, steps: int) -> list[list[Action]]:
    """Looped breadth-first schedule: rank r hosts the v stages r, r + N, …, r + (v−1)N.

    Each rank runs the forwards of its first chunk for all m micro-batches, then of its next
    chunk, …; then the backwards chunk by chunk in reverse, each chunk's micro-batches in
    reverse order (the last forwarded first, as torch runs them); then ``U`` on each of its
    stages (flush). The order is torch 2.13's ``ScheduleLoopedBFS`` runtime order.

    Every stage holds all m micro-batches' activations before its first backward (GPipe's
    memory: v·m chunk activations per rank). On unit costs (a chunk's F and B take F and B)
    one step takes (F + B)·(v·max(m, N) + min(m, N) − 1): for m ≥ N the bubble is
    (N−1)/(v·m + N − 1) of the step, the interleaved schedule's (breadth-first and depth-first
    looping divide the bubble by the same factor v); for m < N each chunk waits for its
    input and the step takes (F + B)(v·N + m − 1).

    Args:
        n_ranks: devices N (the pipeline has N·v stages).
        v: stages (model chunks) per rank.
        m: micro-batches per step.

    Source: Lamy-Poirier, Breadth-First Pipeline Parallelism, arXiv 2211.05953, §3 and §4
    (looping pipelines, breadth-first schedule); torch.distributed.pipelining's ScheduleLoopedBFS.
    """
    one: list[list[Action]] = []
    for r in range(n_ranks):
        stages = [c * n_ranks + r for c in range(v)]
        acts = [Action(s, F, k) for s in stages for k in range(m)]
        acts += [Action(s, B, k) for s in reversed(stages) for k in reversed(range(m))]
        acts += [Action(s, U) for s in stages]
        one.append(acts)
    return _repeat(one, m, steps)


def interleaved_zb_rounds(n_ranks: int, m: int) -> int:
    """Rounds of torch's interleaved zero-bubble schedule: max(1, ⌊m/N⌋); m must be a multiple of it."""
    return max(1, m // n_ranks)


def interleaved_zero_bubble(n_ranks: int, v: int, m: int, steps: int) -> list[list[Action]]:
    """Interleaved ZB1P: interleaved 1F1B with the backward split into I and W, W delayed to
    fill the bubbles; rank r hosts the v stages r, r + N, …, r + (v−1)N.

    Micro-batches go through the chunks in rounds of m / R micro-batches, R = max(1, ⌊m/N⌋)
    (Megatron's groups of N when N divides m). Rank r (0-based) runs (v−1)·m/R + N − 1 − r
    warm-up forwards (chunks in increasing order, a round at a time), then repeats [F; I; and,
    once more than r I's have run, the W of the I r places back] with the backwards visiting the
    chunks in reverse, a round at a time, then the remaining [I; W], then the pending W's, then
    ``U`` on each of its stages (flush). The order is torch 2.13's ``ScheduleInterleavedZeroBubble`` runtime order; with
    v = 1 it is :func:`zb_h1`'s.

    On unit costs F = I = W per chunk with N | m the step takes 3·v·m + N − 1 chunk-action
    times: the bubble is (N − 1) chunk-action times per rank and step, (N−1)/(3·v·m + N − 1)
    of the step (ZB-H1's (N−1)(T_F + T_I − T_W) with chunk-sized actions, 1/v of zb-h1's).

    Args:
        n_ranks: devices N (the pipeline has N·v stages).
        v: stages (model chunks) per rank.
        m: micro-batches per step; a multiple of max(1, ⌊m/N⌋) (as torch requires).

    Source: Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, §3.1 (ZB-H1) applied
    to the interleaved schedule; torch.distributed.pipelining's ScheduleInterleavedZeroBubble
    (``_get_1f1b_rank_ops`` with ``enable_zero_bubble``).
    """
    per_round = m // interleaved_zb_rounds(n_ranks, m)
    total = v * m
    one: list[list[Action]] = []
    for r in range(n_ranks):
        warmup = min((v - 1) * per_round + n_ranks - 1 - r, total)

        def fwd_stage(j: int) -> int:
            return (j // per_round) % v * n_ranks + r

        def bwd_stage(j: int) -> int:
            return (v - 1 - (j - warmup) // per_round % v) * n_ranks + r

        next_mb: dict[tuple[ActionKind, int], int] = {}

        def act(kind: ActionKind, stage: int) -> Action:
            k = next_mb.get((kind, stage), 0)
            next_mb[(kind, stage)] = k + 1
            return Action(stage, kind, k)

        acts: list[Action] = []
        backwards: list[int] = []  # op index of each I, in order: its W follows the same chunk
        for j in range(total + warmup):
            if j < total:
                acts.append(act(F, fwd_stage(j)))
            if j >= warmup:
                acts.append(act(I, bwd_stage(j)))
                backwards.append(j)
                if j - warmup >= r:
                    acts.append(act(W, bwd_stage(backwards[len(backwards) - 1 - r])))
        done_w = max(0, len(backwards) - r)
        acts += [act(W, bwd_stage(j)) for j in backwards[done_w:]]
        acts += [Action(c * n_ranks + r, U) for c in range(v)]
        one.append(acts)
    return _repeat(one, m, steps)


def v_stages(n_ranks: int, rank: int) -> tuple[int, int]:
    """The two stages rank r holds in a V-shaped placement: r and 2N − 1 − r (the first chunk goes
    down the ranks, the second comes back up, so stages N − 1 and N share rank N − 1)."""
    return rank, 2 * n_ranks - 1 - rank


def zbv(n_ranks: int, m: int, steps: int) -> list[list[Action]]:
    """ZB-V (zero-bubble V): two chunks per rank placed in a V (:func:`v_stages`), the backward
    split into I and W; torch 2.13's ``ScheduleZBVZeroBubble`` order.

    Rank r (0-based) with chunks c0 = r and c1 = 2N − 1 − r runs, on ``max(m, 2N − 1)`` micro-batch
    slots (slots ≥ m dropped afterwards): 2(N − r) − 1 forwards of c0; r × [F c1, F c0]; (N − r) ×
    [F c1, I c1, W c1]; while c1 has forwarded less than c0 or c0 has slots left: [F c0 (if any
    left), I c0, W c0, F c1, I c1, W c1]; then r × [I c0, I c1] and (N − r) × [I c0, W c0 (oldest
    pending)]; then the pending W of c1, then of c0; then ``U`` on both stages (flush).

    On unit costs F = I = W per chunk the busiest device holds 1F1B's activations (N stage-sized
    micro-batches = 2N chunk-sized) and the bubble is the fill and drain of one step; the source's
    "zero bubble" holds across steps once m ≥ 2N − 1 with optimizer post-validation (no flush),
    which unbubble does not do: the bubble per flushed step is measured in the tests.

    Source: Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, §6 (ZB-V); torch's
    ScheduleZBVZeroBubble.
    """
    slots = max(2 * n_ranks - 1, m)
    one: list[list[Action]] = []
    for r in range(n_ranks):
        c0, c1 = v_stages(n_ranks, r)
        count = {(c, k): 0 for c in (c0, c1) for k in (F, I, W)}
        acts: list[Action] = []

        def run(stage: int, kind: ActionKind) -> None:
            acts.append(Action(stage, kind, count[(stage, kind)]))
            count[(stage, kind)] += 1

        for _ in range(2 * (n_ranks - r) - 1):
            run(c0, F)
        for _ in range(r):
            run(c1, F)
            run(c0, F)
        for _ in range(n_ranks - r):
            run(c1, F)
            run(c1, I)
            run(c1, W)
        while count[(c1, F)] < count[(c0, F)] or count[(c0, F)] < slots:
            if count[(c0, F)] < slots:
                run(c0, F)
            run(c0, I)
            run(c0, W)
            run(c1, F)
            run(c1, I)
            run(c1, W)
        for _ in range(r):
            run(c0, I)
            run(c1, I)
        for _ in range(n_ranks - r):
            run(c0, I)
            run(c0, W)
        while count[(c1, W)] < count[(c1, I)]:
            run(c1, W)
        while count[(c0, W)] < count[(c0, I)]:
            run(c0, W)
        one.append([a for a in acts if a.mb < m] + [Action(c0, U), Action(c1, U)])
    return _repeat(one, m, steps)


def dualpipev(n_ranks: int, m: int, steps: int) -> list[list]:
    """DualPipeV: DeepSeek's DualPipe folded onto N ranks, two chunks per rank placed in a V
    (:func:`v_stages`), a forward of one chunk overlapped with a backward of the other as one
    compound action (:class:`~unbubble.schedules.actions.Overlap`); torch 2.13's
    ``ScheduleDualPipeV`` order. Needs m ≥ 2N.

    Rank r with chunks c0 = r, c1 = 2N − 1 − r: (N − r − 1)·2 × F c0; (r + 1) × [F c0, F c1];
    (N − r − 1) × [I c1, the oldest pending W, F c1]; (m − 2N + r + 1) × [(F c0; B c1), (F c1;
    B c0)] (the last rank runs its first pair unoverlapped); (N − r − 1) × [B c1, (F c1; B c0)];
    (r + 1) × [backward c1, backward c0], switching from B to I half-way (on c1 first for odd r, on
    c0 first for even r); (N − r − 1) × [the oldest pending W, backward c0]; the remaining W's;
    then ``U`` on both stages (flush).

    Bubble and memory (DeepSeek-V3, arXiv 2412.19437, Table 2; DualPipe's README for DualPipeV):
    (PP/2 − 1)(F&B + B − 3W) per step with PP = 2N chunks, F&B the duration of an overlapped pair,
    2× a chunk's parameters and PP + 1 chunk activations per device — measured against the
    simulator in the tests.

    Source: DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437, §3.2.1 (DualPipe);
    deepseek-ai/DualPipe (DualPipeV); torch's ScheduleDualPipeV.
    """
    one: list[list] = []
    for r in range(n_ranks):
        c0, c1 = v_stages(n_ranks, r)
        count = {(c, k): 0 for c in (c0, c1) for k in (F, I, W)}
        pending_w: list[tuple[int, int]] = []
        acts: list = []

        def take(stage: int, kind: ActionKind) -> Action:
            """The next action of ``kind`` on ``stage``; B counts as I and W (it is both)."""
            key = (stage, I if kind is B else kind)
            a = Action(stage, kind, count[key])
            count[key] += 1
            if kind is I:
                pending_w.append((stage, a.mb))
            return a

        def weight() -> None:
            if pending_w:
                stage, k = pending_w.pop(0)
                acts.append(Action(stage, W, k))

        for _ in range((n_ranks - r - 1) * 2):
            acts.append(take(c0, F))
        for _ in range(r + 1):
            acts += [take(c0, F), take(c1, F)]
        for _ in range(n_ranks - r - 1):
            acts.append(take(c1, I))
            weight()
            acts.append(take(c1, F))
        for i in range(m - 2 * n_ranks + r + 1):
            if i == 0 and r == n_ranks - 1:  # as the source: the last rank's first pair is not overlapped
                acts += [take(c0, F), take(c1, B)]
            else:
                acts.append(Overlap(take(c0, F), take(c1, B)))
            acts.append(Overlap(take(c1, F), take(c0, B)))
        for _ in range(n_ranks - r - 1):
            acts.append(take(c1, B))
            acts.append(Overlap(take(c1, F), take(c0, B)))
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            acts.append(take(c1, I if split else B))
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            acts.append(take(c0, I if split else B))
        for _ in range(n_ranks - r - 1):
            weight()
            acts.append(take(c0, I if split else B))
        for _ in range(r + 1):
            weight()
        one.append(acts + [Action(c0, U), Action(c1, U)])
    return _repeat(one, m, steps)
