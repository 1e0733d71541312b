"""After-rollback processing: exception classification, failure tracking, back-off, the processor."""
