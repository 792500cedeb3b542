"""Kafka fixtures: one tansu broker per test session (skips clearly when the binary is missing)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kafka_broker():
    """A running tansu Kafka-protocol broker (memory storage) on a free port; killed by PID after."""
    from devkit.kafka_broker import BrokerUnavailable, KafkaBroker

    broker = KafkaBroker()
    try:
        broker.start()
    except BrokerUnavailable as e:
        pytest.skip(f"no Kafka-protocol broker: {e}")
    yield broker
    broker.stop()
