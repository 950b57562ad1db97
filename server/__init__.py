"""The gRPC translation server (torch-free): engine (queue, budgets, loop) over a running batch,
service, metrics, config, process lifecycle."""
