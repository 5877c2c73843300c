"""Where the library parts push their statistics (imports nothing of ``app``).

The loader and the sampler report what happens as it happens, by metric name
(DESIGN.md, Metrics, without the ``feedline_`` prefix), to a sink they are
given: ``inc`` a counter, ``set`` a gauge, ``observe`` a histogram. They never
know who listens. ``feedline.metrics.PrometheusSink`` turns the pushes into
``/metrics``; ``NullSink`` (the default) costs one no-op call.
"""

from __future__ import annotations

from typing import Protocol


class StatsSink(Protocol):
    """Receives counters, gauges and observations; must be cheap and thread-safe."""

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None: ...

    def set(self, name: str, value: float, **labels: str) -> None: ...

    def observe(self, name: str, value: float, **labels: str) -> None: ...


class NullSink:
    """Drops everything: the default when nobody listens."""

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        pass

    def set(self, name: str, value: float, **labels: str) -> None:
        pass

    def observe(self, name: str, value: float, **labels: str) -> None:
        pass


class Tee:
    """Sends every push to each of several sinks, in order."""

    def __init__(self, *sinks: StatsSink):
        self.sinks = sinks

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        for s in self.sinks:
            s.inc(name, value, **labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        for s in self.sinks:
            s.set(name, value, **labels)

    def observe(self, name: str, value: float, **labels: str) -> None:
        for s in self.sinks:
            s.observe(name, value, **labels)


def combine(*sinks: StatsSink | None) -> StatsSink:
    """One sink for several, skipping ``None`` and ``NullSink``s: no extra call where nobody listens."""
    real = [s for s in sinks if s is not None and not isinstance(s, NullSink)]
    if not real:
        return NullSink()
    return real[0] if len(real) == 1 else Tee(*real)


class Labelled:
    """Adds fixed labels to every push (a mixing sidecar's part: ``source="web"``)."""

    def __init__(self, sink: StatsSink, **labels: str):
        self.sink = sink
        self.labels = labels

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.sink.inc(name, value, **labels, **self.labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self.sink.set(name, value, **labels, **self.labels)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.sink.observe(name, value, **labels, **self.labels)
