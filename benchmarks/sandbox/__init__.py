"""Hostile programs against the code sandbox: sources, judges, host watch, `decentrl bench sandbox`."""
