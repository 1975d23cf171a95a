"""Collectives, process groups and the collective benchmark."""
