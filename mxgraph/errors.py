"""Errors that mxgraph raises for bad input: each says what is wrong and how to fix it."""


class PlanError(ValueError):
    """A Plan field is impossible, inconsistent with the model or world, or not built yet."""


class TraceError(RuntimeError):
    """A model could not be traced; the message names the module and the op."""
