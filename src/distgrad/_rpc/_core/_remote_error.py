"""Exceptions across the wire: raised remotely, re-raised locally with type and traceback."""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any

from ..._wire._choice import restricted_loads

__all__ = [
    "RemoteTraceback",
    "decode_escapes",
    "error_payload",
    "exception_from_payload",
    "remember_traceback",
    "report_udf_error",
]

# Where an exception was first raised, as text, for copies that travel without their frames.
_TRACEBACK_ATTR = "_distgrad_traceback"


def _traceback_text(exc: BaseException) -> str:
    saved = getattr(exc, _TRACEBACK_ATTR, None)
    if isinstance(saved, str):
        return saved
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def remember_traceback(copy: BaseException, original: BaseException) -> None:
    """Give ``copy`` the traceback text of ``original`` (what an error reply will show)."""
    try:
        setattr(copy, _TRACEBACK_ATTR, _traceback_text(original))
    except AttributeError:  # an exception type without __dict__
        pass


def decode_escapes(text: str) -> str:
    """``text`` with its backslash escapes decoded, as torch's caller decodes a remote
    exception's message (``msg.encode("utf-8").decode("unicode_escape")``): the ``\\n`` that
    ``repr(e)`` writes for a line break becomes one.

    Unlike torch's, characters outside ASCII survive (torch's turns each UTF-8 byte into a
    Latin-1 character), and text with a malformed escape (a Windows path's ``\\N``, a
    trailing backslash) is kept as it is, where torch's raises ``UnicodeDecodeError``."""
    if "\\" not in text:
        return text
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return text


class RemoteTraceback(Exception):
    """Carries the remote traceback text; set as ``__cause__`` of a re-raised remote error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def error_payload(exc: BaseException, where: str, builtin: bool = False) -> tuple[str, str, bytes]:
    """What an ERROR frame carries: ``(message, traceback text, pickled type)``.

    The message is the reference's (``"On WorkerInfo(...):\\n{repr(e)}\\n{traceback}"``,
    its escapes decoded as torch's caller decodes them: :func:`decode_escapes`), so a caller's
    ``match=`` keeps working; errors of builtin operators, and exceptions whose class
    sets ``verbatim_over_rpc`` (distgrad's own chained errors), keep their bare message.
    The type travels by reference in a nested pickle, so that a type the caller cannot import
    still leaves the message readable (it then arrives as RuntimeError).

    Never raises: an exception whose ``repr()``/``str()`` raises is reported as a
    RuntimeError naming its type and that failure (as torch's reports it), since a payload
    that cannot be built would leave the caller waiting for an answer that never comes.
    """
    try:
        tb = _traceback_text(exc)
    except Exception as format_error:
        tb = f"<the traceback could not be formatted: {format_error!r}>\n"
    exc_type: type[BaseException] = type(exc)
    verbatim = builtin or getattr(exc, "verbatim_over_rpc", False)
    try:
        message = str(exc) if verbatim else decode_escapes(f"On {where}:\n{exc!r}\n{tb}")
    except Exception as text_error:
        exc_type = RuntimeError
        message = (
            f"On {where}:\n{type(exc).__qualname__} (its {'str' if verbatim else 'repr'}() "
            f"raised {type(text_error).__name__}: {text_error})\n{tb}"
        )
    try:
        pickled_type = pickle.dumps(exc_type, protocol=5)
    except Exception:
        pickled_type = pickle.dumps(RuntimeError, protocol=5)
    return message, tb, pickled_type


def report_udf_error(exc: BaseException, where: str) -> None:
    """Print what the reference's callee prints when a Python function called over RPC raises:
    ``On {worker}:\n{repr(e)}\n{traceback}`` on its stderr (torch's ``_run_function``).
    Programs and their operators read these callee-side logs; the caller gets the error too."""
    try:
        print(f"On {where}:\n{exc!r}\n{_traceback_text(exc)}", file=sys.stderr, flush=True)
    except Exception:  # a closed or broken stderr must not keep the error from the caller
        pass


def exception_from_payload(message: str, tb: str, pickled_type: bytes) -> BaseException:
    """Rebuild the remote exception with its original type (as the reference does)."""
    error: BaseException
    try:
        exc_type: Any = restricted_loads(pickled_type)  # (the allow-list applies, if any)
    except Exception:
        exc_type = RuntimeError
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        exc_type = RuntimeError
    try:
        error = exc_type(message)
    except Exception as construct_error:
        error = RuntimeError(  # torch's message, "RuntimeError: " in front included
            f"RuntimeError: Failed to create original exception type. Error msg was "
            f"{construct_error} "
            f"Original exception on remote side was {message}"
        )
    error.__cause__ = RemoteTraceback(tb)
    try:
        error.remote_traceback = tb  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return error
