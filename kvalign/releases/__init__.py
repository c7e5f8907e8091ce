"""Releases: the versions behind a verdict, per-release environments and local builds; imports only :mod:`kvalign.errors`."""
