"""The listener container: consume loop, transaction units, runners, after-rollback driver and their ports."""
