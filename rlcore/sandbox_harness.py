"""The program that runs inside the sandbox: it loads model-written code and calls one of
its functions on each test input, reporting what came back.

It is run by the jail's own Python (`python -I -S`, standard library only) and never
imported by the lab. It reads one JSON object from stdin: `code`, `entry_point`, `inputs`
(each a Python literal of the argument tuple) and `test_seconds`. It writes one JSON line
per input on the stdout it was given: {"i": index, "value": repr of the return value} or
{"i": index, "error": what went wrong}. The candidate's own prints go to stderr.

Nothing here decides whether a test passed: the expected values never enter the jail,
and the lab compares the reported values outside it. Code that tampers with this
program (exits early, patches it, prints fake result lines) can only lose results or
report values, never make a wrong value count as right.
"""

import ast
import copy
import json
import os
import signal
import sys

PLAIN_TYPES = (int, float, str, bool, type(None), list, tuple, dict, set, frozenset, bytes)
MAX_VALUE_CHARS = 100_000


class TestTimeout(BaseException):
    """Raised into the candidate when one test overruns its share of the time."""


def plain_repr(value, depth=0):
    """repr of a value made only of plain data types (exact types, so an int subclass with
    an always-true __eq__ is refused), or raise TypeError naming what was not."""
    if depth > 50:
        raise TypeError("value nests deeper than 50 levels")
    kind = type(value)
    if kind not in PLAIN_TYPES:
        raise TypeError(f"returned a {kind.__name__}, not plain data")
    if kind in (list, tuple, set, frozenset):
        for item in value:
            plain_repr(item, depth + 1)
    elif kind is dict:
        for key, item in value.items():
            plain_repr(key, depth + 1)
            plain_repr(item, depth + 1)
    elif kind is float and value != value:
        raise TypeError("returned NaN")
    if depth:
        return None
    text = repr(value)
    if len(text) > MAX_VALUE_CHARS:
        raise TypeError(f"value is {len(text)} characters long; the limit is {MAX_VALUE_CHARS}")
    return text


def on_alarm(signum, frame):
    raise TestTimeout()


def main():
    request = json.loads(sys.stdin.read())
    inputs = [ast.literal_eval(text) for text in request["inputs"]]
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the candidate's prints go to stderr, not into the result lines
    sys.stdout = sys.stderr

    def report(index, **fields):
        results.write(json.dumps({"i": index, **fields}) + "\n")
        results.flush()

    namespace = {"__name__": "__candidate__"}
    try:
        exec(compile(request["code"], "<candidate>", "exec"), namespace)
    except BaseException as exc:  # SystemExit included: loading must define the function
        report(-1, error=f"loading the code raised {type(exc).__name__}: {exc}"[:500])
        return
    function = namespace.get(request["entry_point"])
    if not callable(function):
        report(-1, error=f"the code defines no function {request['entry_point']!r}")
        return
    signal.signal(signal.SIGALRM, on_alarm)
    for index, arguments in enumerate(inputs):
        try:
            signal.setitimer(signal.ITIMER_REAL, request["test_seconds"])
            value = function(*copy.deepcopy(arguments))
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(index, value=plain_repr(value))
        except TestTimeout:
            report(index, error=f"timed out after {request['test_seconds']} s")
        except BaseException as exc:  # the candidate's failure is this test's result
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(index, error=f"{type(exc).__name__}: {exc}"[:500])


if __name__ == "__main__":
    main()
