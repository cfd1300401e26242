"""Small utilities every part shares: atomic file writes, the resolution of a device and a precision,
and the command-line apps' one-line errors."""
