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
    """``" (did you mean 'x'?)"`` for the closest of ``valid`` to ``word`` (difflib's ratio ≥ 0.6),
    or ``""`` when none is close: the hint every "unknown name" error ends with."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(v) for v in valid], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
