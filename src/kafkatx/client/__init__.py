"""The Kafka client layer (private): every librdkafka call kafkatx makes, made safe.

``producer`` (the transactional producer), ``retry`` (KIP-1050 retries),
``bounded`` (deadlines librdkafka cannot ignore), ``topics``, ``offsets``,
``partitions`` (pause and resume that a revoked partition does not fail),
``log`` (librdkafka's log lines through logging) and ``brokers`` (what is
known about the embedded broker without starting one).
"""
