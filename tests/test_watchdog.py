"""The bound on kernel waits (prime_kernels.set_wait_timeout / wait_timeout) and the report path of what kernels
leave behind (prime_kernels.check_device_errors). The timed-out wait itself is provoked in a child process by the
fault matrix (tests/fault_cases.py, wait_timeout_probe_*): it loses the CUDA context."""

import math

import pytest

import prime_kernels


def test_wait_timeout_is_settable_and_bounded():
    old = prime_kernels.wait_timeout()
    assert old > 0 and math.isfinite(old)
    try:
        prime_kernels.set_wait_timeout(2.5)
        assert prime_kernels.wait_timeout() == pytest.approx(2.5)
        prime_kernels.set_wait_timeout(3600)
        assert prime_kernels.wait_timeout() == pytest.approx(3600)
    finally:
        prime_kernels.set_wait_timeout(old)
    assert prime_kernels.wait_timeout() == pytest.approx(old)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 3600.5, True, "5"])
def test_wait_timeout_rejects_what_is_not_a_duration(bad):
    old = prime_kernels.wait_timeout()
    with pytest.raises(ValueError, match="set_wait_timeout"):
        prime_kernels.set_wait_timeout(bad)
    assert prime_kernels.wait_timeout() == old, "a refused value changed the timeout"


def test_check_device_errors_is_quiet_when_nothing_happened():
    prime_kernels.check_device_errors()  # no kernel ran or nothing was found: no error, no device needed
    prime_kernels.check_device_errors()
