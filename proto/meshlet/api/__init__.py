"""meshlet's wire contracts: generated protobuf modules, well-known values and codecs."""
