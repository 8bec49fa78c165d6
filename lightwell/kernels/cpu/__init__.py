"""CPU kernels in C, compiled at first use with the system compiler and called through ctypes."""
