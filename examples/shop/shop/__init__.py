"""An example shop: web (FastAPI) takes orders and calls store (gRPC) for stock."""
