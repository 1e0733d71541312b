"""The unit of work and its commit: one transaction over consumed records, its rewinds, database steps and refusals."""
