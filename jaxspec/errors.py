"""Structured input errors: which field or config key, the value found, what is wrong and
what would be valid. Imports nothing heavy, so library classes and the config both use it."""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "FieldError"]


class FieldError(ValueError):
    """A library class refusing one of its fields.

    Args:
        owner: the class (or function) whose field it is, e.g. "TreeSpec".
        field: the field's name, e.g. "budget".
        value: the value refused.
        problem: what is wrong, as a phrase ("must be an int >= 1").
        valid: what would pass ("an int >= 1"), or None.
        message: the exception's text when the class words it differently; default
            "<owner>.<field>=<value>: <problem>; valid: <valid>".
    """

    def __init__(self, owner: str, field: str, value: Any, problem: str,
                 valid: str | None = None, *, message: str | None = None):
        self.owner, self.field, self.value = owner, field, value
        self.problem, self.valid = problem, valid
        if message is None:
            message = f"{owner}.{field}={value!r}: {problem}"
            if valid:
                message += f"; valid: {valid}"
        super().__init__(message)


class ConfigError(ValueError):
    """One bad config entry: the full dotted key, the value found and what would be valid.

    Args:
        key: the dotted config key ("draft.tree.budget"); relative to a section while the
            section is being built.
        value: the value found.
        problem: what is wrong with it.
        valid: what would be valid, or None.
    """

    def __init__(self, key: str, value: Any, problem: str, valid: str | None = None):
        self.key, self.value, self.problem, self.valid = key, value, problem, valid
        msg = f"config key '{key}' = {value!r}: {problem}"
        if valid:
            msg += f"; valid: {valid}"
        super().__init__(msg)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed under the section `prefix`."""
        if not prefix:
            return self
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(key, self.value, self.problem, self.valid)
