"""What the tests and the benchmarks share, so that neither imports the other: a local
Kafka-protocol broker (`kafka_broker`), synthetic traces shaped like real traffic
(`synthetic`) and the collector / store helpers of the stream checks (`stream_helpers`).
Not part of the installed package."""
