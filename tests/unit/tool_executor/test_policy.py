import resource
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tool_executor import policy
from services.tool_executor.policy import Ending, Status

MAXIMA = policy.Maxima(
    default_timeout_s=10,
    max_timeout_s=60,
    default_memory_mb=1024,
    max_memory_mb=4096,
    output_hard_limit_bytes=1 << 20,
    max_open_files=64,
    max_processes=32,
)


def test_limits_default_and_explicit():
    assert policy.resolve_limits(None, None, MAXIMA) == policy.Limits(10.0, 1024)
    assert policy.resolve_limits(2.5, 256, MAXIMA) == policy.Limits(2.5, 256)
    assert policy.resolve_limits(60, 4096, MAXIMA) == policy.Limits(60.0, 4096)


@pytest.mark.parametrize(
    ("timeout", "memory", "message"),
    [(61, None, "timeout_s=61 exceeds"), (None, 4097, "memory_mb=4097 exceeds"), (0, None, "positive"), (float("inf"), None, "positive"), (None, -1, "positive")],
)
def test_limits_above_maxima_are_refused_not_clamped(timeout, memory, message):
    with pytest.raises(policy.LimitError, match=message):
        policy.resolve_limits(timeout, memory, MAXIMA)


def test_rlimits_cover_cpu_memory_files_processes():
    limits = dict((r, (s, h)) for r, s, h in policy.rlimits_for(policy.Limits(2.2, 100), MAXIMA, base_address_space_bytes=50 << 20))
    assert limits[resource.RLIMIT_CPU] == (4, 4)  # ceil(2.2) + 1 slack
    assert limits[resource.RLIMIT_AS] == (150 << 20, 150 << 20)
    assert limits[resource.RLIMIT_FSIZE] == (1 << 20, 1 << 20)
    assert limits[resource.RLIMIT_NOFILE] == (64, 64)
    assert limits[resource.RLIMIT_NPROC] == (32, 32)
    assert limits[resource.RLIMIT_CORE] == (0, 0)


def ending(**kw):
    base = dict(exit_code=0, term_signal=None, timed_out=False, stdout_bytes=0, stderr_bytes=0, output_hard_limit_bytes=1000, stderr_tail="")
    return Ending(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        ({}, Status.OK),
        ({"exit_code": 3}, Status.ERROR),
        ({"exit_code": 1, "stderr_tail": "Traceback ...\nZeroDivisionError: division by zero\n"}, Status.ERROR),
        ({"exit_code": None, "term_signal": signal.SIGSEGV}, Status.ERROR),
        ({"exit_code": None, "term_signal": signal.SIGKILL, "timed_out": True}, Status.TIMEOUT),
        ({"exit_code": None, "term_signal": signal.SIGXCPU}, Status.TIMEOUT),
        ({"exit_code": 1, "stdout_bytes": 1000}, Status.OUTPUT_LIMIT),
        ({"exit_code": 1, "stderr_bytes": 1000}, Status.OUTPUT_LIMIT),
        ({"exit_code": None, "term_signal": signal.SIGXFSZ}, Status.OUTPUT_LIMIT),
        ({"exit_code": 1, "stderr_tail": "  File \"<cell>\", line 1\nMemoryError\n"}, Status.MEMORY),
        ({"exit_code": 1, "stderr_tail": "x\nnumpy._core._exceptions._ArrayMemoryError: Unable to allocate 8 GiB\n"}, Status.MEMORY),
        ({"exit_code": None, "term_signal": signal.SIGKILL}, Status.MEMORY),  # OOM killer
        # The kernel's RLIMIT_CPU kill (soft == hard: SIGKILL, not SIGXCPU) of a call that burnt
        # its CPU time before the wall-clock deadline: a timeout; a SIGKILL well below it: OOM.
        ({"exit_code": None, "term_signal": signal.SIGKILL, "cpu_s": 3.0, "cpu_limit_s": 3.0}, Status.TIMEOUT),
        ({"exit_code": None, "term_signal": signal.SIGKILL, "cpu_s": 2.9, "cpu_limit_s": 3.0}, Status.TIMEOUT),
        ({"exit_code": None, "term_signal": signal.SIGKILL, "cpu_s": 1.2, "cpu_limit_s": 3.0}, Status.MEMORY),
        ({"exit_code": None, "term_signal": signal.SIGKILL, "cpu_s": 3.0}, Status.MEMORY),  # limit unknown
        # A timed-out call that also filled its output is a timeout: the deadline came first.
        ({"exit_code": None, "term_signal": signal.SIGKILL, "timed_out": True, "stdout_bytes": 1000}, Status.TIMEOUT),
        # MemoryError mentioned in normal output is not a memory failure.
        ({"exit_code": 1, "stderr_tail": "MemoryError is a class\nValueError: nope\n"}, Status.ERROR),
    ],
)
def test_classify(kw, status):
    assert policy.classify(ending(**kw)) is status


def test_the_cpu_limit_is_read_from_the_rlimits():
    rlimits = policy.rlimits_for(policy.Limits(timeout_s=2.5, memory_mb=64), MAXIMA, 0)
    assert policy.cpu_limit_s(rlimits) == 3 + policy.CPU_RLIMIT_SLACK_S  # ceil(2.5) + slack
    assert policy.cpu_limit_s([]) is None


def test_cap_output_keeps_short_text_and_replaces_bad_bytes():
    assert policy.cap_output(b"hello\n", 100) == ("hello\n", False)
    text, truncated = policy.cap_output(b"ok \xff\xfe end", 100)
    assert text == "ok \ufffd\ufffd end" and not truncated


def test_cap_output_elides_the_middle():
    data = b"A" * 500 + b"B" * 1000 + b"C" * 500
    text, truncated = policy.cap_output(data, 100)
    assert truncated
    assert text.startswith("A" * 50) and text.endswith("C" * 50)
    assert "[1900 characters elided]" in text


@given(st.text(max_size=3000), st.integers(min_value=10, max_value=500))
def test_cap_output_property(text, cap):
    out, truncated = policy.cap_output(text.encode("utf-8", errors="surrogatepass"), cap)
    decoded = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    if len(decoded) <= cap:
        assert (out, truncated) == (decoded, False)
    else:
        assert truncated
        head, tail = cap // 2, cap - cap // 2
        assert out.startswith(decoded[:head]) and out.endswith(decoded[len(decoded) - tail :])
        assert len(out) <= cap + len(policy.ELISION_MARKER.format(n=len(decoded)))


def test_choose_kind():
    pattern = policy.heavy_pattern(["numpy", "np", "sympy"])
    assert policy.choose_kind("print(1+1)", pattern) is policy.Kind.LIGHT
    assert policy.choose_kind("import sympy\nsympy.factorint(10)", pattern) is policy.Kind.HEAVY
    assert policy.choose_kind("x = np.arange(3)", pattern) is policy.Kind.HEAVY
    assert policy.choose_kind("snp = 3  # numpyish", pattern) is policy.Kind.LIGHT


@pytest.mark.parametrize(
    ("code", "expected"),
    [(None, (0, None)), (0, (0, None)), (3, (3, None)), (256 + 4, (4, None)), (True, (1, None)), ("bye", (1, "bye"))],
)
def test_system_exit_codes_like_cpython(code, expected):
    assert policy.exit_code_from_system_exit(code) == expected


def test_may_use_random():
    assert policy.may_use_random("import random\nprint(random.random())")
    assert policy.may_use_random("from sympy import randprime")
    assert policy.may_use_random("import numpy as np\nnp.random.rand(3)")
    assert not policy.may_use_random("print(sum(range(10)))")
