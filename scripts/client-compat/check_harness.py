"""The harness shared by checks.py and checks_llamaindex.py: each check is a function run by
check(), which prints one line and records a failure, so one run reports every check."""
import asyncio
import sys

failures = []

# One event loop for every async check, as an application has. The clients cache their async
# HTTP clients per process (langchain-openai's default one, on the OpenAI SDK's HTTPX2 since
# openai 3): a second asyncio.run() would find a pooled connection of a closed loop
# ("Event loop is closed"), a matter of the process, not of the protocol.
_loop = asyncio.new_event_loop()


def run_async(coroutine):
    """Runs coroutine to its end on the process's one event loop."""
    return _loop.run_until_complete(coroutine)


def check(name, f):
    try:
        detail = f()
        print(f"ok   {name}" + (f": {detail}" if detail else ""))
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the run goes on
        failures.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(f, cls, needle, **attrs):
    """f must raise cls with needle in its text and, for each of attrs (code=..., param=...),
    that attribute: the OpenAI SDK's error text holds only the error body's message from
    openai 3 on, its code and param are read from the exception's attributes."""
    try:
        f()
    except cls as e:
        expect(needle in str(e), f"{type(e).__name__} without {needle!r}: {e}")
        for name, want in attrs.items():
            expect(getattr(e, name, None) == want, f"{type(e).__name__}.{name} is {getattr(e, name, None)!r}, "
                                                   f"not {want!r}: {e}")
        return f"{type(e).__name__}"
    raise AssertionError(f"no {cls.__name__}")


def finish(label):
    """Closes the event loop, prints the summary line and ends the process: 1 if any check
    failed."""
    _loop.run_until_complete(_loop.shutdown_asyncgens())
    _loop.close()
    print(f"{label}: {len(failures)} failed" + (f": {', '.join(failures)}" if failures else ""))
    sys.exit(1 if failures else 0)
