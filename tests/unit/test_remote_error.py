"""Unit tests of what an ERROR reply carries (``distgrad._rpc._core._remote_error``): building the
payload never raises, and the caller rebuilds torch's errors from it."""

from __future__ import annotations

import pickle

import pytest

from distgrad._rpc._core._remote_error import error_payload, exception_from_payload


class BadRepr(Exception):
    """An exception whose repr() raises."""

    def __repr__(self) -> str:
        raise ValueError("no repr for you")


class BadStr(Exception):
    """An exception whose str() raises."""

    def __str__(self) -> str:
        raise ValueError("no str for you")


class NeedsTwoArgs(Exception):
    """An exception type that cannot be rebuilt from a message alone."""

    def __init__(self, a: object, b: object) -> None:
        super().__init__(a, b)


def raised(exc: BaseException) -> BaseException:
    """``exc`` after being raised (so that it has a traceback)."""
    try:
        raise exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    ("exc", "builtin", "failing"),
    [(BadRepr("x"), False, "repr"), (BadStr("x"), True, "str")],
    ids=["repr", "str_of_builtin"],
)
def test_payload_of_an_exception_that_cannot_be_shown(
    exc: BaseException, builtin: bool, failing: str
) -> None:
    """An exception whose repr()/str() raises still gives a payload (a caller waits for it):
    a RuntimeError naming the type and the failure, with the traceback."""
    message, tb, pickled_type = error_payload(raised(exc), "WorkerInfo(id=1, name=w1)", builtin)
    assert pickle.loads(pickled_type) is RuntimeError
    assert message.startswith(f"On WorkerInfo(id=1, name=w1):\n{type(exc).__qualname__} ")
    assert f"its {failing}() raised ValueError: no {failing} for you" in message
    assert "Traceback (most recent call last)" in tb
    rebuilt = exception_from_payload(message, tb, pickled_type)
    assert type(rebuilt) is RuntimeError and str(rebuilt) == message


def test_exception_that_cannot_be_rebuilt_has_torchs_message() -> None:
    """A type whose constructor needs two arguments is rebuilt as torch's RuntimeError,
    "RuntimeError: Failed to create original exception type. ..." in front included."""
    message, tb, pickled_type = error_payload(raised(NeedsTwoArgs(1, 2)), "W")
    rebuilt = exception_from_payload(message, tb, pickled_type)
    assert type(rebuilt) is RuntimeError
    assert str(rebuilt).startswith(
        "RuntimeError: Failed to create original exception type. Error msg was "
        "NeedsTwoArgs.__init__() missing 1 required positional argument: 'b' "
        "Original exception on remote side was On W:\nNeedsTwoArgs(1, 2)\n"
    )


def test_local_exception_type_arrives_as_runtime_error() -> None:
    """A type that cannot be pickled (defined in a function) arrives as RuntimeError with the
    original message."""

    class Local(Exception):
        pass

    message, tb, pickled_type = error_payload(raised(Local("here")), "W")
    rebuilt = exception_from_payload(message, tb, pickled_type)
    assert type(rebuilt) is RuntimeError and "Local('here')" in str(rebuilt)
