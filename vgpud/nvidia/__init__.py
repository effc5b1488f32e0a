"""The NVIDIA kernel ABI: escapes, classes, param layouts and their decoders."""
