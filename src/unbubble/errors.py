"""Exceptions raised for user-facing problems (bad configs, schedules, files)."""


class ConfigError(ValueError):
    """A configuration value, file or combination is invalid.

    The message names the offending value, what would be valid and, where
    possible, the option to change (``"a=0 is invalid: must be >= 1 (set --a)"``).
    """


class ScheduleError(RuntimeError):
    """A schedule is malformed or deadlocks; the message names the first offending action."""


class NonFiniteError(RuntimeError):
    """A stage met a non-finite loss or gradient under ``nan_policy="abort"``; the message
    names the stage, the micro-batch and the weight version."""


class PipelineFailure(RuntimeError):
    """A stage process failed, died or hung, or a second signal stopped the run; the message
    names the stage and its last action. Every stage process has been terminated."""


class StartupInterrupted(PipelineFailure):
    """A stop signal (Ctrl-C, SIGTERM) arrived before the run's first step: every stage process
    has been ended at once, since there was nothing to save (the newest checkpoint, or step 0,
    is unchanged)."""


def did_you_mean(word: object, valid) -> str:
    """``" (did you mean 'x'?)"`` for the name of ``valid`` that equals ``word`` but for case, else
    the closest one ignoring case (difflib's ratio ≥ 0.6), or ``""`` when none is close: the hint
    every "unknown name" error carries."""
    import difflib

    names = [str(v) for v in valid]
    by_case = {n.lower(): n for n in names}  # a case slip ('PACI', 'adamW') is the likeliest typo
    if str(word).lower() in by_case:
        return f" (did you mean {by_case[str(word).lower()]!r}?)"
    close = difflib.get_close_matches(str(word).lower(), list(by_case), n=1)
    return f" (did you mean {by_case[close[0]]!r}?)" if close else ""
