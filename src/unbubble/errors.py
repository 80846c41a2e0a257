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
