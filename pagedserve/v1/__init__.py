"""Generated gRPC stubs of pagedserve.v1 (python proto/generate.py)."""
