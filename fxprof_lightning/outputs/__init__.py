"""Where results go: the cycle report and its tables, runs read back from disk, sinks, trackers, pictures."""
