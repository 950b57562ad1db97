"""Locust users and scenarios for the gRPC service. Arrives with the load-test issue."""
