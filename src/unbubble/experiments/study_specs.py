"""The sweeps behind ``paci-study`` and ``br-study`` (issue "settle the seeds' claims"), by size.

Sizes: ``tiny`` (the test suite, < 30 s), ``default`` (the documented study, ≤ 75 min on 2 cores).
Every method of a comparison trains on the same micro-batches (equal tokens) with the same
warm-up fraction (= the same warm-up tokens) and cosine decay to 10 %.
"""

from __future__ import annotations

from typing import Any

LRS = [3e-4, 1e-3, 3e-3]


def paci_spec(size: str) -> dict[str, Any]:
    """PACI's Q1/Q2: flush vs PACI at matched m = a, the stashed control, PipeDream, PipeMare,
    and delay remedies on PACI a = 4, tuned per method at N = 8; a and N scans on one seed."""
    if size == "tiny":
        return {
            "name": "paci-study", "micro_batches": 16, "stages": [2], "lrs": [1e-3, 3e-3], "seeds": [0, 1],
            "evals": 2, "extend_grid": 0, "base": {"optimizer": "adamw", "model": "tiny", "seq_len": 32, "micro_batch_size": 4, "warmup_frac": 0.1,
                                 "warmup_min": 0, "eval_batches": 2},
            "methods": [
                {"label": "1f1b-flush m=2", "schedule": "1f1b-flush", "m": 2},
                {"label": "paci a=2", "schedule": "paci", "a": 2},
                {"label": "paci-stashed a=2", "schedule": "paci-stashed", "a": 2},
                {"label": "paci a=2 + muon", "schedule": "paci", "a": 2, "optimizer": "muon", "lr_from": "paci a=2"},
            ],
        }
    scan = {"lrs": LRS, "extra_seeds": False}
    return {
        "name": "paci-study", "micro_batches": 2400, "stages": [8], "lrs": LRS, "seeds": [0, 1, 2], "evals": 12,
        "extend_grid": 2,
        "seed_stages": [8],
        "base": {"optimizer": "adamw", "model": "deep-cpu", "seq_len": 64, "micro_batch_size": 8, "warmup_frac": 0.1, "warmup_min": 0,
                 "min_lr_ratio": 0.1, "eval_batches": 8},
        "methods": [
            # 1F1B-flush computes the same updates at every N (only its clock changes): run once, at N = 8
            {"label": "1f1b-flush m=4", "schedule": "1f1b-flush", "m": 4},
            {"label": "paci a=4", "schedule": "paci", "a": 4, "stages": [8, 4, 2]},
            {"label": "1f1b-flush m=8", "schedule": "1f1b-flush", "m": 8},
            {"label": "paci a=8", "schedule": "paci", "a": 8},
            {"label": "paci-stashed a=4", "schedule": "paci-stashed", "a": 4},
            {"label": "paci a=4 + basis-rotation", "schedule": "paci", "a": 4, "optimizer": "basis-rotation"},
            {"label": "paci a=4 + muon", "schedule": "paci", "a": 4, "optimizer": "muon"},
            {"label": "paci a=4 + staleness-lr", "schedule": "paci", "a": 4, "optimizer": "staleness-lr",
             "extra_seeds": False},
            # the same optimizers without delay: is a remedy closing the gap, or just a better optimizer?
            {"label": "1f1b-flush m=4 + basis-rotation", "schedule": "1f1b-flush", "m": 4,
             "optimizer": "basis-rotation", "lr_from": "paci a=4 + basis-rotation"},
            {"label": "1f1b-flush m=4 + muon", "schedule": "1f1b-flush", "m": 4, "optimizer": "muon",
             "lr_from": "paci a=4 + muon"},
            # the two matrix-aware remedies at a = 8 too, at their a = 4 lr (three seeds)
            {"label": "paci a=8 + basis-rotation", "schedule": "paci", "a": 8, "optimizer": "basis-rotation",
             "lr_from": "paci a=4 + basis-rotation", "extra_seeds": False},
            {"label": "paci a=8 + muon", "schedule": "paci", "a": 8, "optimizer": "muon", "lr_from": "paci a=4 + muon",
             "extra_seeds": False},
            # one seed (the budget): single-seed rows are marked by their seed count
            {"label": "pipemare", "schedule": "pipemare", "extra_seeds": False},
            {"label": "pipedream", "schedule": "pipedream", "extra_seeds": False},
            {"label": "1f1b-flush m=2", "schedule": "1f1b-flush", "m": 2, **scan},
            {"label": "paci a=2", "schedule": "paci", "a": 2, **scan},
            {"label": "1f1b-flush m=1", "schedule": "1f1b-flush", "m": 1, **scan},
            {"label": "paci a=1", "schedule": "paci", "a": 1, **scan},
        ],
    }


def br_spec(size: str) -> dict[str, Any]:
    """Basis Rotation's delay scaling (P = 1 … 32 stashed, P = 32 without stashing) and ablation:
    each optimizer tuned at P = 1 and P = 32 (stashed), two seeds there for AdamW, PipeDream-LR
    and Basis Rotation (2nd, bilateral); the other depths and variants borrow the tuned lr of the
    nearest tuned depth (``lr_from``). Sized to finish in ≈ 45 min on 2 cores."""
    if size == "tiny":
        return {
            "name": "br-study", "micro_batches": 12, "stages": [1, 4], "lrs": [1e-2], "seeds": [0, 1],
            "evals": 2, "keep_train_curve": True, "seed_stages": [1], "extend_grid": 0,
            "base": {"optimizer": "adamw", "model": "deep32-cpu", "seq_len": 16, "micro_batch_size": 4, "warmup_frac": 0.1,
                     "warmup_min": 0, "eval_batches": 2},
            "methods": [
                {"label": "adamw", "schedule": "pipedream", "optimizer": "adamw", "lrs": [3e-3, 1e-2]},
                {"label": "basis-rotation (2nd, bilateral)", "schedule": "pipedream", "optimizer": "basis-rotation"},
                {"label": "adamw, no stashing", "schedule": "async-1f1b", "optimizer": "adamw", "stages": [4],
                 "lr_from": "adamw"},
            ],
        }
    tuned = [1, 32]
    mid = {"stages": [4, 8, 16], "extra_seeds": False}
    br = {"schedule": "pipedream", "optimizer": "basis-rotation"}
    methods: list[dict[str, Any]] = [
        {"label": "adamw", "schedule": "pipedream", "optimizer": "adamw", "stages": tuned},
        {"label": "pipedream-lr", "schedule": "pipedream", "optimizer": "pipedream-lr", "stages": [32]},
        {"label": "nesterov", "schedule": "pipedream", "optimizer": "nesterov", "stages": tuned, "extra_seeds": False},
        {"label": "basis-rotation (2nd, bilateral)", **br, "stages": tuned},
        {"label": "muon", "schedule": "pipedream", "optimizer": "muon", "stages": tuned, "extra_seeds": False},
    ]
    for m in list(methods):  # the intermediate depths for the three the claims are about
        if m["label"] in ("adamw", "basis-rotation (2nd, bilateral)"):
            methods.append({**m, "label": f"{m['label']} @ P=4-16", **mid, "lr_from": m["label"]})
    for opt, label in (("adamw", "adamw"), ("pipedream-lr", "pipedream-lr"),
                       ("basis-rotation", "basis-rotation (2nd, bilateral)")):
        methods.append({"label": f"{label}, no stashing", "schedule": "async-1f1b", "optimizer": opt,
                        "stages": [32], "extra_seeds": False, "lr_from": label})
    for source, geometry in (("1st", "bilateral"), ("2nd", "unilateral"), ("1st", "unilateral")):
        methods.append({"label": f"basis-rotation ({source}, {geometry})", **br, "br_source": source,
                        "br_geometry": geometry, "stages": tuned, "extra_seeds": False,
                        "lr_from": "basis-rotation (2nd, bilateral)"})
    for alloc in ("stage-aware", "inverse"):
        methods.append({"label": f"basis-rotation (2nd, bilateral), {alloc}", **br, "br_allocation": alloc,
                        "stages": [32], "extra_seeds": False, "lr_from": "basis-rotation (2nd, bilateral)"})
    return {
        "name": "br-study", "micro_batches": 800, "stages": tuned, "lrs": [3e-3, 1e-2, 3e-2], "seeds": [0, 1],
        "extend_grid": 0,  # the budget: a tuned lr at the grid's edge is marked in the tables
        "evals": 8, "seed_stages": tuned, "keep_train_curve": True,
        "base": {"optimizer": "adamw", "model": "deep32-cpu", "seq_len": 32, "micro_batch_size": 8, "warmup_frac": 0.1, "warmup_min": 0,
                 "min_lr_ratio": 0.1, "eval_batches": 8},
        "methods": methods,
    }


#: AdamW (β1, β2) of the momentum scan: β2 = 0.999 with β1 ≥ 0.98, as the high-momentum sources use
#: (Ajanthan et al. 2025's NAdam runs, PluralisResearch/AsyncPP run.bash: β = (0.99, 0.999)).
MOMENTA = {0.9: 0.95, 0.95: 0.95, 0.98: 0.999, 0.99: 0.999}


def overhead_spec(size: str) -> dict[str, Any]:
    """``overhead-study`` at the paci-study horizon: PACI (a = 4) against 1F1B-flush (m = 4) with the
    *same* optimizer settings, each side tuned; the asynchronous side also trains at 1.5×, 2× and
    3× the tokens (``budgets``), so its token overhead is a number.

    Rows tuned in paci-study on the same configuration and seed (AdamW β = (0.9, 0.95) for both
    schedules, PACI + Muon) keep that study's tuned lr as a one-point grid; the other rows tune on
    a two-point grid extended by one round. Exploratory rows (AdamW β1 0.95 and 0.98, Muon μ = 0.98)
    borrow the lr of the nearest tuned setting and run one seed (the 2-hour budget)."""
    if size == "tiny":
        flush, paci = {"schedule": "1f1b-flush", "m": 2}, {"schedule": "paci", "a": 2}
        return {
            "name": "overhead-study", "micro_batches": 16, "stages": [2], "lrs": [3e-3], "seeds": [0, 1], "evals": 2,
            "extend_grid": 0, "budgets": [0.5, 1.5, 2],
            "base": {"optimizer": "adamw", "model": "tiny", "seq_len": 32, "micro_batch_size": 4, "warmup_frac": 0.1, "warmup_min": 0,
                     "eval_batches": 2},
            "methods": [
                {"label": "1f1b-flush m=2", **flush},
                {"label": "paci a=2", **paci, "baseline": "1f1b-flush m=2"},
                {"label": "paci a=2 + prediction", **paci, "predict_weights": "bound", "baseline": "1f1b-flush m=2"},
            ],
        }
    flush, paci = {"schedule": "1f1b-flush", "m": 4}, {"schedule": "paci", "a": 4}
    hi = {"beta1": 0.99, "beta2": 0.999}
    nadam = {"optimizer": "nadam", **hi}
    muon = {"optimizer": "muon"}
    methods: list[dict[str, Any]] = [
        # tuned in paci-study (same configuration, seed 0): 1e-2 of [3e-3, 1e-2, 3e-2] and 1e-3 of [3e-4, 1e-3, 3e-3]
        {"label": "1f1b-flush m=4", **flush, "lrs": [1e-2]},
        {"label": "paci a=4", **paci, "lrs": [1e-3], "baseline": "1f1b-flush m=4"},
        {"label": "1f1b-flush m=4 + adamw β=(0.99, 0.999)", **flush, **hi, "lrs": [3e-3, 1e-2]},
        {"label": "paci a=4 + adamw β=(0.99, 0.999)", **paci, **hi, "lrs": [3e-4, 1e-3],
         "baseline": "1f1b-flush m=4 + adamw β=(0.99, 0.999)"},
        {"label": "1f1b-flush m=4 + nadam β=(0.99, 0.999)", **flush, **nadam, "lrs": [3e-3, 1e-2]},
        {"label": "paci a=4 + nadam β=(0.99, 0.999)", **paci, **nadam, "lrs": [3e-4, 1e-3],
         "baseline": "1f1b-flush m=4 + nadam β=(0.99, 0.999)"},
        {"label": "1f1b-flush m=4 + muon", **flush, **muon, "lrs": [1e-2, 3e-2]},
        # tuned in paci-study: 1e-2 of [3e-4 … 3e-2]
        {"label": "paci a=4 + muon", **paci, **muon, "lrs": [1e-2], "baseline": "1f1b-flush m=4 + muon"},
        {"label": "paci a=4 + muon + prediction", **paci, **muon, "predict_weights": "bound", "lrs": [3e-3, 1e-2],
         "baseline": "1f1b-flush m=4 + muon"},
        {"label": "paci a=4 + muon + prediction (measured s)", **paci, **muon, "predict_weights": "measured",
         "lr_from": "paci a=4 + muon + prediction", "extra_seeds": False, "baseline": "1f1b-flush m=4 + muon",
         "budgets": []},
        # Muon μ = 0.98 at μ = 0.95's tuned lrs (the orthogonalised step's size does not depend on μ)
        {"label": "1f1b-flush m=4 + muon μ=0.98", **flush, **muon, "muon_momentum": 0.98,
         "lr_from": "1f1b-flush m=4 + muon", "extra_seeds": False},
        {"label": "paci a=4 + muon μ=0.98", **paci, **muon, "muon_momentum": 0.98, "lr_from": "paci a=4 + muon",
         "baseline": "1f1b-flush m=4 + muon μ=0.98", "budgets": [], "extra_seeds": False},
    ]
    for b1, source in ((0.95, ""), (0.98, " + adamw β=(0.99, 0.999)")):  # exploratory: one seed, borrowed lr
        betas = {"beta1": b1, "beta2": MOMENTA[b1]}
        name = f" + adamw β=({b1}, {MOMENTA[b1]})"
        methods += [{"label": f"1f1b-flush m=4{name}", **flush, **betas, "lr_from": f"1f1b-flush m=4{source}",
                     "extra_seeds": False},
                    {"label": f"paci a=4{name}", **paci, **betas, "lr_from": f"paci a=4{source}", "extra_seeds": False,
                     "baseline": f"1f1b-flush m=4{name}", "budgets": []}]
    return {
        "name": "overhead-study", "micro_batches": 2400, "stages": [8], "lrs": LRS, "seeds": [0, 1], "evals": 12,
        "extend_grid": 1, "budgets": [1.5, 2, 3],
        "base": {"optimizer": "adamw", "model": "deep-cpu", "seq_len": 64, "micro_batch_size": 8, "warmup_frac": 0.1, "warmup_min": 0,
                 "min_lr_ratio": 0.1, "eval_batches": 8},
        "methods": methods,
    }


def horizon_spec(h1: dict[str, Any], tuned: dict[str, float], pairs: list[tuple[str, str]],
                 horizon: float, one_seed: list[tuple[str, str]] = ()) -> dict[str, Any]:
    """The longer-horizon sweep of ``overhead-study``: each (asynchronous, synchronous) pair of
    ``h1`` (labels) at ``horizon`` × its tokens, at the lr tuned at 1× (``tuned``: label → lr;
    not re-tuned), with every seed (the first only for the pairs in ``one_seed``) and no budgets."""
    by_label = {m["label"]: m for m in h1["methods"]}
    keep = ("label", "lrs", "lr_from", "extra_seeds", "baseline", "budgets", "stages")
    methods = []
    for pair in pairs:
        for label in pair:
            if any(m["label"] == f"{label} @{horizon:g}×" for m in methods):
                continue
            m = {k: v for k, v in by_label[label].items() if k not in keep}
            m.update(label=f"{label} @{horizon:g}×", lrs=[tuned[label]], horizon=horizon)
            if pair in one_seed and not any(pair != p and label in p for p in pairs if p not in one_seed):
                m["extra_seeds"] = False
            if label == pair[0]:
                m["baseline"] = f"{pair[1]} @{horizon:g}×"
                m["budgets"] = []
            methods.append(m)
    return {**h1, "name": f"{h1['name']}-{horizon:g}x", "methods": methods, "extend_grid": 0, "budgets": []}


#: Token budgets of the longer horizons: below 1 when 1× already meets the twin, so the overhead is
#: a number and not "≤ 1"; 1.5 only when 1.3 falls short (the budgets are trained in order).
LONG_BUDGETS = [0.85, 0.92, 1.15, 1.3, 1.5]


def horizon_study_spec(size: str, part: str = "main") -> dict[str, Any]:
    """``horizon-study`` (asynchrony at length), in two sweeps run one after the other:

    * ``part="main"``: the token overhead of PACI + Muon + weight prediction at 4× the horizon
      (budgets ``LONG_BUDGETS``; the lr checked at 4× on seed 0: the 1× tuned lr and one step
      lower, on both sides) and error feedback (``--error-feedback 1``) at 1× on PACI + Muon and
      PACI + AdamW, with and without prediction, each at the tuned lr of the same method without
      it (a one-point grid; its corrections telescope to c·(u_T − u_0), so the total step is the
      optimizer's);
    * ``part="trend"``: the same method at 2× (budgets), the middle point of the trend.

    Both reuse overhead-study's published runs whose settings are identical
    (:func:`~unbubble.experiments.sweep.reuse_runs`), so the 1× rows and flush + Muon at 4× are
    not trained again."""
    h1 = overhead_spec(size)
    tiny = size == "tiny"
    flush, paci = ("1f1b-flush m=2", "paci a=2") if tiny else ("1f1b-flush m=4", "paci a=4")
    by = {m["label"]: m for m in h1["methods"]}
    sched_f, sched_p = by[flush], by[paci]
    mlr, alr = ([3e-3], [3e-3]) if tiny else ([1e-2], [1e-3])  # the tuned lrs of overhead-study
    muon = {"optimizer": "muon"}
    pred = {"predict_weights": "bound"}
    ef = {"error_feedback": 1.0}
    keep = ("schedule", "m", "a")

    def base_of(m: dict[str, Any]) -> dict[str, Any]:
        return {k: m[k] for k in keep if k in m}

    f, p = base_of(sched_f), base_of(sched_p)
    fm, pmp = f"{flush} + muon", f"{paci} + muon + prediction"
    long_lrs = [1e-3, 3e-3] if tiny else [3e-3, 1e-2]
    if part == "trend":
        mid = 1.5 if tiny else 2.0
        methods = [{"label": f"{fm} @{mid:g}×", **f, **muon, "lrs": mlr, "horizon": mid},
                   {"label": f"{pmp} @{mid:g}×", **p, **muon, **pred, "lrs": mlr, "horizon": mid,
                    "baseline": f"{fm} @{mid:g}×", "budgets": LONG_BUDGETS}]
    else:
        long = 2.0 if tiny else 4.0
        flr = [3e-3] if tiny else [1e-2]
        methods = [
            # the longer horizon first (the longest runs start first), lr checked there on seed 0
            {"label": f"{fm} @{long:g}×", **f, **muon, "lrs": long_lrs, "horizon": long},
            {"label": f"{pmp} @{long:g}×", **p, **muon, **pred, "lrs": long_lrs, "horizon": long,
             "baseline": f"{fm} @{long:g}×", "budgets": LONG_BUDGETS},
            {"label": fm, **f, **muon, "lrs": mlr},
            {"label": pmp, **p, **muon, **pred, "lrs": mlr, "baseline": fm},
            {"label": f"{paci} + muon", **p, **muon, "lrs": mlr, "baseline": fm},
            {"label": flush, **f, "lrs": flr},
            {"label": paci, **p, "lrs": alr, "baseline": flush},
            # error feedback at 1×, and AdamW + prediction (the control EF + prediction needs), each at
            # the tuned lr of the same method without it (a one-point grid: they start in phase 1)
            {"label": f"{paci} + muon + error feedback", **p, **muon, **ef, "lrs": mlr, "baseline": fm},
            {"label": f"{pmp} + error feedback", **p, **muon, **pred, **ef, "lrs": mlr, "baseline": fm},
            {"label": f"{paci} + prediction", **p, **pred, "lrs": alr, "baseline": flush, "budgets": [1.5, 2]},
            {"label": f"{paci} + error feedback", **p, **ef, "lrs": alr, "baseline": flush, "budgets": [1.5, 2]},
            {"label": f"{paci} + prediction + error feedback", **p, **pred, **ef, "lrs": alr,
             "baseline": flush, "budgets": [1.5, 2]},
        ]
    return {**h1, "name": "horizon-study" + ("" if part == "main" else f"-{part}"), "methods": methods,
            "extend_grid": 0, "budgets": [1.5, 2, 3]}


#: Budgets of pays-study: both sides of 1 near it, so a token overhead close to 1 is bracketed.
PAYS_BUDGETS = [0.85, 0.92, 1.08, 1.15, 1.3, 1.5]

#: Budgets of pays-study's N = 16 part (PACI's overhead there is far above 1).
DEEP16_BUDGETS = [1.5, 2.0, 2.5, 3.0]

#: pays-study's parts, in the order they train (issue "where asynchrony pays": 1, 2, 5, 3, 4).
PAYS_PARTS = ("default", "llama", "deep16", "few", "switch")

#: The switch part's synchronous fractions: 1F1B-flush for this share of the updates, then PACI.
SWITCH_FRACTIONS = (0.05, 0.10, 0.25)


def pays_study_spec(size: str, part: str = "default") -> dict[str, Any]:
    """``pays-study`` (where asynchrony pays, docs/architecture.md#comparing-convergence): the default remedy, PACI + Muon + error
    feedback (c = 1), against 1F1B-flush + Muon at the same m, each part one resumable sweep:

    * ``default``: N = 8, a = m = 4 at 4× the horizon (2,400 updates), 3 seeds with budgets on both
      sides of 1; prediction's 4× row gets its third seed; flush + Muon at 4× its third; one
      published row (PACI + Muon + prediction at 1×, seed 0) re-run at the current commit;
    * ``llama``: the same at 4× on ``llama-deep-cpu`` (RMSNorm, RoPE, SwiGLU, GQA), 2 seeds;
    * ``deep16``: N = 16 on ``deep32-cpu`` (2 blocks per stage), a = m = 4 and a = m = 8, 2×, 3 paired
      seeds, each side's lr bracketed (two rounds of grid extension), budgets 1.5× to 3×;
    * ``few``: N = 8, a = m = 2, 2×, 2 seeds;
    * ``switch``: synchronous, then asynchronous (:mod:`unbubble.switch`): N = 8, a = m = 4, 1F1B-flush +
      Muon for 5 %, 10 % or 25 % of the updates, then PACI + Muon + error feedback, at 1× and 4× the
      horizon, 3 paired seeds, each with its own twin and the unswitched PACI trained at the same commit
      (lr 1e-2: tuned for both sides at 1× and 4×).

    Every lr is checked on seed 0 at the part's horizon (the 1× tuned 1e-2 and one step lower, on
    both sides). ``default`` keeps horizon-study's labels and settings so its published 4× runs are
    reused (:func:`~unbubble.experiments.sweep.reuse_runs`)."""
    if part not in PAYS_PARTS:
        raise ValueError(f"pays-study has no part {part!r}; valid: {', '.join(PAYS_PARTS)}")
    h1 = overhead_spec(size)
    tiny = size == "tiny"
    muon = {"optimizer": "muon"}
    ef, pred = {"error_feedback": 1.0}, {"predict_weights": "bound"}
    lrs = [3e-3] if tiny else [3e-3, 1e-2]  # tiny: one lr (the suite's time), the machinery the same
    base = dict(h1["base"])
    seeds = [0, 1] if tiny else [0, 1, 2]

    def pair(m: int, h: float, suffix: str = "") -> list[dict[str, Any]]:
        f, p = f"1f1b-flush m={m} + muon{suffix} @{h:g}×", f"paci a={m} + muon + error feedback{suffix} @{h:g}×"
        return [{"label": f, "schedule": "1f1b-flush", "m": m, **muon, "lrs": lrs, "horizon": h},
                {"label": p, "schedule": "paci", "a": m, **muon, **ef, "lrs": lrs, "horizon": h, "baseline": f,
                 "budgets": PAYS_BUDGETS}]

    if part == "default":
        long = 2.0 if tiny else 4.0
        mm = 2 if tiny else 4
        methods = pair(mm, long)
        methods.append({"label": f"paci a={mm} + muon + prediction @{long:g}×", "schedule": "paci", "a": mm, **muon,
                        **pred, "lrs": lrs, "horizon": long, "baseline": methods[0]["label"],
                        "budgets": LONG_BUDGETS})
        # a published row re-run at the current commit: where does it land against its seed spread?
        methods.append({"label": f"paci a={mm} + muon + prediction (re-run)", "schedule": "paci", "a": mm, **muon,
                        **pred, "lrs": [lrs[-1]], "extra_seeds": False})
        stages = h1["stages"]
    elif part == "llama":
        base["model"] = "llama-tiny" if tiny else "llama-deep-cpu"
        methods, stages, seeds = pair(2 if tiny else 4, 1.0 if tiny else 4.0, " (llama)"), h1["stages"], [0, 1]
    elif part == "deep16":
        base["model"] = "tiny" if tiny else "deep32-cpu"
        methods = pair(2, 1.0) if tiny else pair(4, 2.0) + pair(8, 2.0)
        stages, seeds = ([4] if tiny else [16]), [0, 1] if tiny else [0, 1, 2]
        if not tiny:  # deep32-cpu's block is 32 tokens: 16 × 32 keeps the 512 tokens per micro-batch
            base.update(seq_len=32, micro_batch_size=16)
            # seed 0's tuned PACI ended 0.13-0.19 above its twin, a gap its flush curve closes only
            # after 2/3 of the run: budgets from 1.5x to 3x bracket an overhead near 2
            for m in methods[1::2]:
                m["budgets"] = DEEP16_BUDGETS
            # each side's lr bracketed: after one round three best lrs were still the grid's largest
            return {**h1, "name": "pays-study-deep16", "base": base, "stages": stages, "seeds": seeds,
                    "methods": methods, "extend_grid": 2, "budgets": PAYS_BUDGETS}
    elif part == "switch":
        mm, stages = (2 if tiny else 4), h1["stages"]
        methods = []
        for h in ((1.0,) if tiny else (1.0, 4.0)):
            duo = pair(mm, h, " (switch part)")
            methods += duo
            for frac in (SWITCH_FRACTIONS[1:2] if tiny else SWITCH_FRACTIONS):
                methods.append({**duo[1], "label": f"flush {frac:.0%} → " + duo[1]["label"], "switch_at": frac,
                                "lrs": [lrs[-1]]})
            duo[0]["lrs"] = duo[1]["lrs"] = [lrs[-1]]
    else:
        methods, stages, seeds = pair(1 if tiny else 2, 1.0 if tiny else 2.0), h1["stages"], [0, 1]
    if tiny and part != "default":  # the suite's time: one seed, half the micro-batches
        seeds, h1 = [0], {**h1, "micro_batches": h1["micro_batches"] // 2}
    return {**h1, "name": "pays-study" + ("" if part == "default" else f"-{part}"), "base": base, "stages": stages,
            "seeds": seeds, "methods": methods, "extend_grid": 0, "budgets": PAYS_BUDGETS}


def clip_study_spec(size: str) -> dict[str, Any]:
    """``clip-study`` (what global clipping costs in quality, docs/architecture.md#global-operations-are-barriers): 1F1B-flush + Muon with
    the exact global clip (``sync``) against PACI + Muon + error feedback (c = 1, the default) with
    ``sync``, ``stale`` and ``stage`` and without clipping, at overhead-study's horizon (N = 8,
    a = m = 4, 600 updates), clip 1.0 (torchtitan's, Megatron's and nanoGPT's default), 2 seeds.

    The two ``sync`` rows tune on a two-point grid (the no-clip tuned 1e-2 and 3e-2: clipping may
    allow a larger step); ``stale`` and ``stage`` take PACI ``sync``'s lr. The unclipped rows keep
    overhead-study's tuned lr and are reused from horizon-study's published runs."""
    h1 = overhead_spec(size)
    tiny = size == "tiny"
    flush, paci = ({"schedule": "1f1b-flush", "m": 2}, {"schedule": "paci", "a": 2}) if tiny else \
        ({"schedule": "1f1b-flush", "m": 4}, {"schedule": "paci", "a": 4})
    tag_f, tag_p = f"1f1b-flush m={flush['m']} + muon", f"paci a={paci['a']} + muon + error feedback"
    muon, ef = {"optimizer": "muon"}, {"error_feedback": 1.0}
    lr = [3e-3] if tiny else [1e-2]
    grid = [3e-3, 1e-2] if tiny else [1e-2, 3e-2]

    def clip(scope: str) -> dict[str, Any]:
        return {"clip_grad_norm": 1.0, "clip_scope": scope}

    methods = [
        {"label": tag_f, **flush, **muon, "lrs": lr},
        {"label": tag_p, **paci, **muon, **ef, "lrs": lr, "baseline": tag_f},
        {"label": f"{tag_f} + clip sync", **flush, **muon, **clip("sync"), "lrs": grid},
        {"label": f"{tag_p} + clip sync", **paci, **muon, **ef, **clip("sync"), "lrs": grid,
         "baseline": f"{tag_f} + clip sync"},
        {"label": f"{tag_p} + clip stale", **paci, **muon, **ef, **clip("stale"), "lr_from": f"{tag_p} + clip sync",
         "baseline": f"{tag_f} + clip sync"},
        {"label": f"{tag_p} + clip stage", **paci, **muon, **ef, **clip("stage"), "lr_from": f"{tag_p} + clip sync",
         "baseline": f"{tag_f} + clip sync"},
    ]
    return {**h1, "name": "clip-study", "methods": methods, "extend_grid": 0, "budgets": []}
