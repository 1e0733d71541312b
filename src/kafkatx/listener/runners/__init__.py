"""The runners that turn a transaction unit's records into handler calls: one at a time, or concurrently."""
