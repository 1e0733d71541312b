"""Placeholder smoke check: start the embedded broker, produce and read back."""
from kafkatx.local import LocalBroker
from kafkatx.testing import create_topic, produce, read_topic

with LocalBroker() as broker:
    topic = create_topic(broker.bootstrap_servers)
    produce(broker.bootstrap_servers, topic, [b"hello", b"kafkatx"])
    print([r.value for r in read_topic(broker.bootstrap_servers, topic)])
