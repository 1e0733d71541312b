"""When something fails: a failed record, the after-rollback path, process crashes, outages and Kafka errors."""
