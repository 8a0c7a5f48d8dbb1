"""HTTP for the proxy: HTTP/1.1 and HTTP/2 engines over a shared routing contract."""
