"""Package data of the emulator: the Metal shim header and the fiber runtime (C++)."""
