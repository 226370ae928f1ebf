"""Errors that mxgraph raises for bad input: each says what is wrong and how to fix it.

`UserError` is the mark of input the person running mxgraph can fix (a plan, a model, a
data file, a flag): the CLI prints its message as one line and exits with status 2,
where any other exception is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input, described in the user's terms with the fix."""


class PlanError(UserError, ValueError):
    """A Plan field is impossible, inconsistent with the model or world, or not built yet."""


class TraceError(UserError, RuntimeError):
    """A model could not be traced; the message names the module and the op."""


class DataError(UserError, ValueError):
    """A training data file is missing, unreadable or not in an accepted format."""
