"""Exceptions raised for user-facing problems (bad configs, schedules, files)."""


class ConfigError(ValueError):
    """A configuration value, file or combination is invalid.

    The message names the offending value, what would be valid and, where
    possible, the option to change (``"a=0 is invalid: must be an integer ≥ 1 (set --a)"``).
    """


class ScheduleError(RuntimeError):
    """A schedule is malformed or deadlocks; the message names the first offending action."""


class NonFiniteError(RuntimeError):
    """A stage met a non-finite loss or gradient under ``nan_policy="abort"``; the message
    names the stage, the micro-batch and the weight version."""


class PipelineFailure(RuntimeError):
    """A stage process failed, died or hung, or a second signal stopped the run; the message
    names the stage and its last action. Every stage process has been terminated."""


class Diverged(PipelineFailure):
    """Training diverged: a non-finite loss, validation loss or weight after the non-finite guard's
    own skips (``nan_policy``). The run folder's summary.json says ``"status": "diverged"``; the
    message names the step, what was non-finite and the fix."""


class StartupInterrupted(PipelineFailure):
    """A stop signal (Ctrl-C, SIGTERM) arrived before the run's first step: every stage process
    has been ended at once, since there was nothing to save (the newest checkpoint, or step 0,
    is unchanged)."""


class SecondSignal(KeyboardInterrupt):
    """A second stop signal (not the first one's echo) ended the run at once; ``signame`` names it
    (``"SIGINT"``). The engines turn it into a :class:`PipelineFailure` that says which checkpoint
    is kept (:func:`unbubble.runtime.launch.stopped_at_once`)."""

    def __init__(self, signame: str):
        super().__init__(f"second {signame}: stopped at once")
        self.signame = signame


def check_int(name: str, value: object, lo: int | None = 1, fix: str = "", hi: int | None = None, *,
              valid: str | None = None, error: type[Exception] = ConfigError, integers: tuple = (int,)) -> None:
    """The one check of "an integer, not a bool, in lo..hi" (``None``: unbounded on that side).

    Args:
        name: what the message calls the value (``"a"``, ``"straggler stage"``).
        value: the value checked; a bool is refused though Python counts it an int (``True`` is no count).
        lo: the smallest valid value.
        fix: the option to set or what the value means, shown in parentheses (``"set --a"``).
        hi: the largest valid value.
        valid: what is valid, where the range alone does not say it (default ``"must be an integer ≥ lo"``,
            ``"must be an integer in lo..hi"``, ``"must be an integer"``).
        error: the exception raised (a call site's own: ``ConfigError``, ``ValueError``, ``TypeError``).
        integers: the types that count as integers (``(int, np.integer)`` where numpy's are taken too).

    Raises:
        ``error``: ``"name=value is invalid: <valid> (<fix>)"`` when ``value`` is a bool, not one of
        ``integers``, or outside lo..hi.
    """
    if not isinstance(value, bool) and isinstance(value, integers) and (lo is None or value >= lo) \
            and (hi is None or value <= hi):
        return
    if valid is None:
        valid = ("must be an integer" if lo is None and hi is None else f"must be an integer ≥ {lo}" if hi is None
                 else f"must be an integer ≤ {hi}" if lo is None else f"must be an integer in {lo}..{hi}")
    raise error(f"{name}={value!r} is invalid: {valid}" + (f" ({fix})" if fix else ""))


#: Names people commonly type for a valid one: ``did_you_mean`` offers the meaning (``adam`` is AdamW here, an
#: ``a100`` the 80 GB preset), which edit distance gets wrong ('adam' is closest to 'nadam', 'a100x' to 'h100').
#: An alias is offered only where its target is among the valid names of that option.
ALIASES: dict[str, str] = {
    # --optimizer
    "adam": "adamw",
    # --hardware
    "a100": "a100-80g", "a100-80gb": "a100-80g", "a100-sxm": "a100-80g",
    "h100-80g": "h100", "h100-sxm": "h100", "h200-141g": "h200", "h200-sxm": "h200",
    # --precision
    "bfloat16": "bf16", "float32": "fp32", "autocast": "bf16-autocast", "amp": "bf16-autocast",
    # --schedule
    "1f1b": "1f1b-flush", "interleaved": "interleaved-1f1b", "zero-bubble": "zb-h1", "pipedream-flush": "1f1b-flush",
    # --tokenizer
    "bpe": "gpt2", "tiktoken": "gpt2",
}


def did_you_mean(word: object, valid) -> str:
    """``" (did you mean 'x'?)"`` for the name of ``valid`` that equals ``word`` but for case, else the
    one a common alias of :data:`ALIASES` means, else the closest spelling ignoring case (difflib's
    ratio ≥ 0.6) among the valid names and their aliases (so 'a100x' finds 'a100-80g' through 'a100'),
    else the only name the word begins ('emu' → 'emulator'), or ``""`` when none is close: the hint every "unknown name" error carries."""
    import difflib

    names = [str(v) for v in valid]
    by_case = {n.lower(): n for n in names}  # a case slip ('PACI', 'adamW') is the likeliest typo
    low = str(word).lower()
    if low in by_case:
        return f" (did you mean {by_case[low]!r}?)"
    # each spelling (a valid name or an alias of one) -> the valid name it stands for
    spellings = {**{a: by_case[t.lower()] for a, t in ALIASES.items() if t.lower() in by_case},
                 **{n: v for n, v in by_case.items()}}
    if low in spellings:
        return f" (did you mean {spellings[low]!r}?)"
    close = difflib.get_close_matches(low, list(spellings), n=1)
    if not close and len(low) >= 2:  # an abbreviation ('emu', 'inter'): the one name it begins
        close = sorted({spellings[s] for s in spellings if s.startswith(low)})
        close = close if len(close) == 1 else []
        return f" (did you mean {close[0]!r}?)" if close else ""
    return f" (did you mean {spellings[close[0]]!r}?)" if close else ""
