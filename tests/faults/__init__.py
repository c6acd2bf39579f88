"""Fault injection against real kernels; each test adds a row to the table printed at the end."""
