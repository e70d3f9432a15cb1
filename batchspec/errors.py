"""User errors: shown as one line, no traceback, each with its exit code."""


class UserError(Exception):
    """Something the user can fix that is not an option problem (exit 1)."""

    exit_code = 1


class UsageError(UserError):
    """Options that cannot work together, or name something that is not there (exit 2)."""

    exit_code = 2
