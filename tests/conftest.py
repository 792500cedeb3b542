"""Topic-specific fixtures (tests/conftest_*.py), imported here; the fixtures the tests and the
benchmarks' own tests share (the test models, one torch thread) are in devkit/fixtures.py,
registered for every test by the repository's root conftest.py."""

from __future__ import annotations

from tests.conftest_eagle import eagle_traffic, stories_eagle_dir, stories_eagle_init_dir  # noqa: F401
from tests.conftest_kafka import kafka_broker  # noqa: F401
