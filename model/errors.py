"""Errors a user can fix, shared by every caller of model/ (the `bert` command, the worker).

`UserError` says what is wrong with the user's input (a missing file, a bad option, data that does
not fit the model) in one line. The CLI prints it and exits with status 2; the worker stores it as a
failed job's error. Anything else that escapes model/ is a bug, reported with its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input: one line, no traceback."""
