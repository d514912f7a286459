"""Engine worker processes: the loop (``main``), the engine interface (``base``), engines."""
