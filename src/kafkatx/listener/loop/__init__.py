"""The consume loop and its stages: the container thread, its poll, the overlapped commits, idle and health duties."""
