"""The gRPC translation server: engine, scheduler, service, metrics. Arrives with the server issue."""
