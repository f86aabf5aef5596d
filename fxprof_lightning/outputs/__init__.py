"""Where results go: the cycle report to files, TensorBoard, the console and the trackers; runs read back from disk; pictures; how the `fxprof` command writes numbers and its HTML page."""
