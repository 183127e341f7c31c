"""Checks of user arguments, in one place: the rules every public entry point shares.

A bool is never taken for a number (`True` is an `int` in Python), a range is checked where
it is stated, and an error is a `ValueError` that names the argument, says what it must be
and shows what was received: "`period` must be an integer >= 1 (local steps between
averaging rounds). Received: 0". Each check returns the value, so that a constructor can
check and keep in one line.
"""

import math


def fail(name, what, value):
    """Raises the `ValueError` of argument `name`, which must be `what`."""
    raise ValueError(f"`{name}` must be {what}. Received: {value!r}")


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_bool(name, value):
    """`value` if it is True or False."""
    if not isinstance(value, bool):
        fail(name, "True or False", value)
    return value


def check_int(name, value, what=None, low=None, high=None, allow_none=False):
    """`value` if it is an integer within `[low, high]` (either bound may be None), or None
    where `allow_none`; `what` says what it must be (default from the bounds)."""
    if value is None and allow_none:
        return None
    if not is_int(value) or (low is not None and value < low) or (
            high is not None and value > high):
        fail(name, what or _int_words(low, high, allow_none), value)
    return value


def check_number(name, value, what, low=None, high=None, low_open=False, high_open=False,
                 allow_none=False):
    """`value` if it is a finite number within the bounds (`low_open` / `high_open`: the
    bound itself excluded), or None where `allow_none`; `what` says what it must be."""
    if value is None and allow_none:
        return None
    if not is_number(value) or not math.isfinite(value) or (low is not None and (
            value <= low if low_open else value < low)) or (high is not None and (
            value >= high if high_open else value > high)):
        fail(name, what, value)
    return value


def check_seconds(name, value, allow_none=False):
    """`value` if it is a positive (finite) number of seconds, or None where `allow_none`."""
    what = "a positive number of seconds" + (" or None" if allow_none else "")
    return check_number(name, value, what, low=0, low_open=True, allow_none=allow_none)


def check_fraction(name, value, low_open=True):
    """`float(value)` if it is a number in (0, 1] (`low_open`) or [0, 1]."""
    return float(check_number(name, value, f"a number in {'(' if low_open else '['}0, 1]",
                              low=0, high=1, low_open=low_open))


def _int_words(low, high, allow_none):
    if low is not None and high is not None:
        words = f"an integer between {low} and {high}"
    elif low == 1:
        words = "a positive integer"
    elif low is not None:
        words = f"an integer >= {low}"
    else:
        words = "an integer"
    return words + (" or None" if allow_none else "")
