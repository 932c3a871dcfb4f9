"""Placement: resolving device specs, device scopes, moving data and modules."""
