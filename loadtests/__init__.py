"""Locust users and scenarios, the SLO checker, and the offline and served benchmarks."""
