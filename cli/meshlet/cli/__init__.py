"""The `meshlet` command line."""
