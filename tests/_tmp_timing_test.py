import time, pytest
from tests.test_fault_injection import Harness, mc, _closers  # noqa
from kafkatx.testing import running
def test_timing(mc):
    h = Harness(mc)
    t0 = time.monotonic()
    h.app.start(); t1 = time.monotonic()
    h.produce(b"a"); t2 = time.monotonic()
    h.wait_committed(1); t3 = time.monotonic()
    h.assert_keeps_processing(); t4 = time.monotonic()
    h.app.stop(); t5 = time.monotonic()
    print(f"\nstart {t1-t0:.2f} produce {t2-t1:.2f} commit {t3-t2:.2f} keep {t4-t3:.2f} stop {t5-t4:.2f}")
