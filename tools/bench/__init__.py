"""Micro-benchmarks of kvroute's hot paths (`kvroute bench ...`). Each prints one JSON object last."""
