"""The circuit breaker's contract, on a fake clock (``kvtier.tiers.breaker``)."""

from __future__ import annotations

from kvtier.tiers.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_node_that_never_timed_out_is_never_blocked():
    breaker = CircuitBreaker(clock=Clock())
    assert breaker.blocked(["a", "b"]) is None
    assert breaker.open_nodes() == []


def test_a_timed_out_node_is_skipped_for_its_backoff_then_probed_by_one_call():
    clock = Clock()
    breaker = CircuitBreaker(base=1.0, cap=30.0, clock=clock)
    assert breaker.timed_out("a", TimeoutError()) == 1.0
    assert breaker.blocked(["b", "a"]) == "a"
    assert breaker.blocked(["b"]) is None  # other nodes are not affected
    clock.now = 1.0
    assert breaker.blocked(["a"]) is None  # this call is the probe ...
    assert breaker.blocked(["a"]) == "a"  # ... and the others wait for it
    breaker.answered("a")
    assert breaker.blocked(["a"]) is None
    assert breaker.open_nodes() == []


def test_the_backoff_doubles_while_the_node_stays_hung_up_to_the_cap():
    clock = Clock()
    breaker = CircuitBreaker(base=1.0, cap=5.0, clock=clock)
    backoffs = []
    for _ in range(5):
        backoffs.append(breaker.timed_out("a", TimeoutError()))
        clock.now += backoffs[-1]
        assert breaker.blocked(["a"]) is None  # the probe, which times out again
    assert backoffs == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_blocked_batch_takes_no_probe_of_its_other_nodes():
    clock = Clock()
    breaker = CircuitBreaker(base=1.0, clock=clock)
    breaker.timed_out("a", TimeoutError())
    clock.now = 0.5
    breaker.timed_out("b", TimeoutError())
    clock.now = 1.2  # a is due, b is not
    assert breaker.blocked(["a", "b"]) == "b"
    assert breaker.blocked(["a"]) is None  # a's probe was not taken by the batch above
