"""User errors: shown as one line, no traceback, each with its exit code."""

EXIT_INTERRUPTED = 75  # a stop signal came: the run is resumable (EX_TEMPFAIL)


class UserError(Exception):
    """Something the user can fix that is not an option problem (exit 1)."""

    exit_code = 1


class UsageError(UserError):
    """Options that cannot work together, or name something that is not there (exit 2)."""

    exit_code = 2


def first_line(error: BaseException) -> str:
    """An exception's message, first line only (library errors can span pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
