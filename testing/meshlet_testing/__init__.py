"""Test support shared by every component's tests; never installed with meshlet."""
