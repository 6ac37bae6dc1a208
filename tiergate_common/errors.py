"""An exception's one-line summary, for logs and for the CLI's single line of error."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)``, or the exception's class name when it has no message.

    Database drivers put the server's whole reply (SQL, parameters, a URL to their docs) in the
    message: the first line is what a log line or the CLI should carry.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
