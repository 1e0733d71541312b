"""The listener container: spec, outputs, send() context, transactional producer, consume loop."""
