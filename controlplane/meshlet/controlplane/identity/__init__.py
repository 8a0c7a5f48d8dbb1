"""The identity service: the mesh's certificate authority."""
